"""The ``autofuse`` sub-commands, one module each: ``add_parser(sub)`` declares the command's flags
(the shared ones come from ``common``'s parent parsers) and sets ``handler``, the function that runs it."""
