"""The master runs where torch is not installed: ``import torch_pccl.master`` and the
``pccl-master`` CLI never import torch, even indirectly (a small machine can host it)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# sys.modules["torch"] = None makes every `import torch` (and `import torch.x`) raise
# ImportError, so an indirect import fails the child instead of passing unnoticed.
BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=45, env=env)


def test_import_master_does_not_import_torch():
    proc = _run("""
        import torch_pccl.master, torch_pccl.master.http, torch_pccl.master.status
        print("loaded", sorted(m for m, mod in sys.modules.items()
                               if m.split(".")[0] == "torch" and mod is not None))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "loaded []", proc.stdout


def test_master_serves_without_torch(tmp_path):
    """The CLI's server starts, forms a group of one from a raw hello and serves /api/status."""
    proc = _run("""
        import asyncio, json, socket, urllib.request
        from torch_pccl.control import protocol
        from torch_pccl.master.server import MasterServer

        async def main():
            server = MasterServer("127.0.0.1", 0, http_port=0, secret=b"")
            await server.start()
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                     "version": protocol.VERSION, "peer_id": "p0",
                                     "data_addr": "127.0.0.1:1"}))
            await w.drain()
            decoder, kinds = protocol.Decoder(protocol.TO_PEER), []
            while "assign" not in kinds:        # the group of one has formed
                data = await asyncio.wait_for(r.read(65536), 10)
                assert data, "the master closed the connection"
                kinds += [m["type"] for m in decoder.feed(data)]
            url = f"http://127.0.0.1:{server.http_port}/api/status"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            w.close()
            await server.stop()
            return json.loads(body)

        status = asyncio.run(main())
        print(status["world_size"], [p["peer_id"] for p in status["peers"]])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 ['p0']", proc.stdout


def test_the_control_package_stands_alone():
    """The protocol, the challenge-response and the address parser the master shares with
    its peers load without torch and without core, master or elastic (issue 22)."""
    proc = _run("""
        import torch_pccl.control.address, torch_pccl.control.auth, torch_pccl.control.protocol
        print(sorted(m for m, mod in sys.modules.items()
                     if m.split(".")[0] in ("torch", "torch_pccl") and mod is not None))
    """)
    assert proc.returncode == 0, proc.stderr
    control = [f"torch_pccl.control{m}"
               for m in ("", ".address", ".auth", ".protocol", ".schemas")]
    assert proc.stdout.strip() == str(["torch_pccl", *control, "torch_pccl.errors"]), proc.stdout


def test_the_peers_client_does_not_load_the_master():
    """A peer's connection to the master speaks the control protocol without loading the
    master's server package."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, torch_pccl.elastic.master_client\n"
         "print(sorted(m for m in sys.modules if m.startswith('torch_pccl.master')))"],
        capture_output=True, text=True, timeout=45)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
