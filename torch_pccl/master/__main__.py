"""``pccl-master`` / ``python -m torch_pccl.master``: run the master in the foreground.

Prints ``pccl-master listening on HOST:PORT`` once bound (``--port 0`` picks a
free port), and ``pccl-master status page on http://HOST:PORT/`` with
``--http-port``; logs joins, leaves, drops and epochs at INFO, and stops cleanly on
Ctrl-C or SIGTERM (exit status 0). Exit status 1 if the address cannot be bound, 2 if
the state file cannot be read or is not a valid record.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .. import config
from .server import MasterServer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pccl-master",
        description="torch_pccl membership master (control plane only; relays no tensor data).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29600, help="TCP port, 0 = any free (default 29600)")
    p.add_argument("--world-size", type=int, default=0,
                   help="peers to wait for before forming the first group; "
                        "0 = form it with the first peer (default 0)")
    p.add_argument("--heartbeat-interval", type=float, default=None, metavar="S",
                   help="seconds between peer heartbeats (default: env "
                        f"PCCL_HEARTBEAT_INTERVAL, else {config.HEARTBEAT_INTERVAL_S:g})")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                   help="drop a peer silent for this many seconds and tell the other members, "
                        "which abort the collectives waiting on it (default: env "
                        f"PCCL_HEARTBEAT_TIMEOUT, else {config.HEARTBEAT_TIMEOUT_S:g})")
    p.add_argument("--round-timeout", type=float, default=config.ROUND_TIMEOUT_S, metavar="S",
                   help="drop members missing from an update round after this many seconds "
                        "(default %(default)g)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="file whose first line is the run's shared secret: every peer must "
                        "prove it before it may join (default: env PCCL_SECRET, else the file "
                        "named by PCCL_SECRET_FILE, else no authentication; docs/security.md)")
    p.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="serve a live status page (/), its JSON (/api/status) and Prometheus "
                        "metrics (/metrics) on this port, 0 = any free; off unless given "
                        "(docs/status-page.md)")
    p.add_argument("--http-host", default="127.0.0.1", metavar="HOST",
                   help="address of the status page (default 127.0.0.1: loopback only, since "
                        "the page names every peer's address; reach it with an SSH tunnel, or "
                        "give 0.0.0.0 together with a shared secret, which then makes every "
                        "request carry a token derived from it: the master logs the page's "
                        "URL with the token)")
    p.add_argument("--state-file", default=None, metavar="PATH",
                   help="keep the run's epoch, roster and shared-state revision in this file "
                        "(written atomically at every change), so that a master restarted "
                        "with it takes the run back at once, without a grace window; a "
                        "missing file is a new run (docs/membership.md)")
    p.add_argument("--resume-grace", type=float, default=None, metavar="S",
                   help="seconds a master that starts without a record of the run holds "
                        "joiners before forming a group from them, so that the members of "
                        "an earlier group re-register first (default: the heartbeat timeout "
                        f"+ {config.RECONNECT_BACKOFF_S[1]:g} s, the members' longest "
                        "reconnect backoff; 0: form a group at once, for a run known to be "
                        "new)")
    p.add_argument("--quiet-epochs", action="store_true",
                   help="let a sync round that every member voted in, with nobody pending, "
                        "grant a quiet epoch: DiLoCo boundaries then send the master nothing "
                        "until a peer is pending (experimental; docs/membership.md, "
                        "\"Quiet epochs\")")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    return p


async def _serve(server: MasterServer) -> int:
    try:
        await server.start()
    except OSError as e:
        print(f"pccl-master: cannot listen on {server.address}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"pccl-master: {e}", file=sys.stderr)
        return 2
    print(f"pccl-master listening on {server.address}", flush=True)
    if server.http_port is not None:
        print(f"pccl-master status page on http://{server.http_host}:{server.http_port}/",
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pccl-master`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is outside 0 .. 65535")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        parser.error(f"--http-port {args.http_port} is outside 0 .. 65535")
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        secret = (config.read_secret_file(args.secret_file, "--secret-file")
                  if args.secret_file is not None else None)
        grace = args.resume_grace
        if grace is None:
            grace = config.resume_grace_s(args.heartbeat_timeout if args.heartbeat_timeout
                                          is not None else config.heartbeat_timeout_s())
        server = MasterServer(args.host, args.port, world_size=args.world_size,
                              heartbeat_interval_s=args.heartbeat_interval,
                              heartbeat_timeout_s=args.heartbeat_timeout,
                              round_timeout_s=args.round_timeout, secret=secret,
                              http_host=args.http_host, http_port=args.http_port,
                              resume_grace_s=grace, state_file=args.state_file,
                              quiet_epochs=args.quiet_epochs)
    except ValueError as e:
        parser.error(str(e))
    return asyncio.run(_serve(server))


if __name__ == "__main__":
    sys.exit(main())
