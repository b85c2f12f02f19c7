"""The launcher's and a replacement's words in the store, read back as the other side reads them: a replacement
waits for ``admitted`` and leaves when the launcher closes admission; the membership's own keys are the ones named
here (tests/distributed/test_elastic.py reads the members' side)."""

import threading
import time
from datetime import timedelta

import torch

from polytrain.distributed.elastic_keys import admitted, close_admission, join_key
from polytrain.distributed.joining import join
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.rendezvous import StoreServer, connect_store


def test_a_waiting_replacement_leaves_as_soon_as_the_launcher_closes_admission():
    server = StoreServer(timedelta(seconds=30))
    try:
        store = connect_store("127.0.0.1", server.port, timedelta(seconds=30))
        joined: dict = {}

        def replacement() -> None:
            own = connect_store("127.0.0.1", server.port, timedelta(seconds=30))
            joined["membership"] = join(own, 1, backend="gloo", device=torch.device("cpu"),
                                        timeout=timedelta(seconds=30), lost=LostRanks(range(2)),
                                        heartbeat_timeout=3.0, launched=2)

        thread = threading.Thread(target=replacement, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not store.check([join_key(1)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.check([join_key(1)]), "the replacement registered"
        assert not admitted(store, 1)
        started = time.monotonic()
        close_admission(store)
        thread.join(10)
        assert not thread.is_alive() and joined["membership"] is None
        assert time.monotonic() - started < 5  # not its 30 s timeout
    finally:
        server.close()
