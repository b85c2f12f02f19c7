import os
import socket
from datetime import timedelta

import pytest

from polytrain.distributed.rendezvous import (StoreServer, _interface_address, bind_listener, connect_store, gloo_interface,
                                       interface_towards, is_loopback, loopback_interface)
from polytrain.errors import ConfigError
from tests.helpers.procs import listening_addresses


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost")
    assert not is_loopback("10.1.2.3") and not is_loopback("no-such-host.invalid")
    assert gloo_interface("127.0.0.1") == loopback_interface()


def test_each_interface_is_found_from_its_own_address():
    found = {name: _interface_address(name) for _, name in socket.if_nameindex()}
    for name, address in found.items():
        if address:
            assert interface_towards(address) == name


def test_listener_refuses_a_taken_port():
    first = bind_listener("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="already in use; pass another --master-port"):
            bind_listener("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


def test_store_listens_only_on_its_address_and_serves_clients():
    server = StoreServer(timedelta(seconds=10))
    try:
        mine = [a for a in listening_addresses([os.getpid()]) if a[1] == server.port]
        assert mine == [("127.0.0.1", server.port)]
        client = connect_store("127.0.0.1", server.port, timedelta(seconds=10))
        client.set("k", "v")
        assert server.store.get("k") == b"v"
    finally:
        server.close()


def test_closing_the_store_closes_its_socket_once(tmp_path):
    """The store owns the listening socket: close() ends it, and a file that reuses its number stays open."""
    import gc
    import os
    import socket

    server = StoreServer(timedelta(seconds=10))
    fd, port = server.fd, server.port
    server.close()
    assert not os.path.exists(f"/proc/self/fd/{fd}")
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more
    with open(tmp_path / "reused", "w") as fh:
        del server
        gc.collect()  # nothing left to close the number a second time
        os.fstat(fh.fileno())
        fh.write("still open")


def test_listener_on_an_address_of_no_interface_is_one_line():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, held by no interface here
    with pytest.raises(ConfigError, match=r"^cannot listen on 192\.0\.2\.1:0: \S.*address"):
        bind_listener("192.0.2.1", 0)
