"""A membership change lets go of the old group: its loopback connections are cut (a peer blocked on one sees the
end at once), all but the store's. Run in a process of its own: it cuts every loopback connection it has."""

import subprocess
import sys

_CHILD = r"""
import socket, threading
from polytrain.distributed.teardown import cut_connections

def pair(listener):
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server

kept_listener, other_listener = socket.socket(), socket.socket()
for listener in (kept_listener, other_listener):
    listener.bind(("127.0.0.1", 0))
    listener.listen()
kept, kept_peer = pair(kept_listener)
cut, cut_peer = pair(other_listener)
got = {}
reader = threading.Thread(target=lambda: got.update(data=cut_peer.recv(1)), daemon=True)
reader.start()  # blocked in a receive, as a collective is
count = cut_connections(keep_port=kept_listener.getsockname()[1])
reader.join(5)
kept.sendall(b"x")
print(count, reader.is_alive(), got.get("data"), kept_peer.recv(1))
"""


def test_cut_connections_ends_this_process_s_loopback_connections_but_the_kept_port_s():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    count, alive, data, kept = out.stdout.split()
    assert int(count) == 2  # both ends of the other pair, none of the kept one
    assert alive == "False" and data == "b''"  # the blocked receive ended: the connection is gone
    assert kept == "b'x'"  # the store's connection still works
