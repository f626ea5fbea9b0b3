"""Fusion patterns, one file each, grouped by family. ``autofuse.registry`` discovers them: every
module here that defines a module-level ``PATTERN`` (an ``autofuse.pattern.Pattern``) is one."""
