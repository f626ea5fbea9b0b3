"""``autofuse rpc tracker|server|status``: TVM's RPC pieces for a measurement farm."""

from __future__ import annotations

import sys

from .common import Parser, positive_int


def add_parser(sub) -> None:
    rpc = sub.add_parser("rpc", help="start TVM's RPC tracker or a server, or show the tracker's queue",
                         description=(
        "Measurement farms with TVM's own RPC pieces. Start a tracker once, one server per device (on this "
        "or other machines) registered under a key, then `autofuse tune --rpc HOST:PORT:KEY`."))
    rpc.set_defaults(handler=run)
    actions = rpc.add_subparsers(dest="rpc_command", metavar="ACTION", parser_class=Parser, required=True)
    tracker = actions.add_parser("tracker", help="run TVM's RPC tracker (python -m tvm.exec.rpc_tracker)",
                                 description="Run TVM's RPC tracker in the foreground until interrupted.")
    tracker.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: all)")
    tracker.add_argument("--port", default=9190, type=positive_int, help="port (default 9190)")
    server = actions.add_parser("server", help="run a TVM RPC server registered at a tracker",
                                description=(
        "Run TVM's RPC server (python -m tvm.exec.rpc_server) in the foreground, registered at --tracker "
        "under --key. Run one per device; on a GPU host pin each to its GPU with CUDA_VISIBLE_DEVICES."))
    server.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the tracker to register at")
    server.add_argument("--key", required=True, help="device key the tuner asks for (e.g. cpu, h200)")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    server.add_argument("--port", default=9090, type=positive_int,
                        help="first port to try (default 9090; the next free one up to +100 is used)")
    status = actions.add_parser("status", help="servers and queue of a tracker",
                                description="Print the servers registered at a tracker and the queue per key.")
    status.add_argument("--tracker", default="127.0.0.1:9190", metavar="HOST:PORT",
                        help="tracker address (default 127.0.0.1:9190)")


def run(args) -> int:
    import os

    from .. import rpc

    if args.rpc_command == "status":
        print(rpc.status_text(rpc.parse_address(args.tracker, need_key=False)))
        return 0
    if args.rpc_command == "tracker":
        command = rpc.tracker_command(args.host, args.port)
    else:
        tracker = rpc.parse_address(args.tracker, need_key=False)
        rpc.summary(tracker)  # fail now, not after TVM's minute of retries
        command = rpc.server_command(tracker, args.key, args.host, args.port)
    print("autofuse: " + " ".join(command[1:]), file=sys.stderr, flush=True)
    os.execv(command[0], command)  # TVM's own process, signals and all
    return 0
