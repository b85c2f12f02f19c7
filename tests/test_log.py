"""Rank-aware logging (polytrain/log.py): a warning every rank would give is printed once, by rank 0; a rank's
own warnings and every error still reach the user from every rank."""

import logging
import warnings

from polytrain.log import EVERY_RANK, get_logger, setup_logging


def test_other_ranks_print_only_their_own_warnings_and_errors(capsys):
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            for rank in (0, 1):
                setup_logging(rank, 2)
                get_logger().warning("--resume: no checkpoint yet")  # every rank would say it
                get_logger("devices").warning("device cuda:1 is not available", extra=EVERY_RANK)
                get_logger().error("failed")
                warnings.warn("a library's own warning", UserWarning)
                logging.getLogger("polytrain").info("step 1")
    finally:
        setup_logging(0, 1)
    out = capsys.readouterr().out
    assert out.splitlines() == ["warning: --resume: no checkpoint yet", "warning: device cuda:1 is not available",
                                "error: failed", "step 1",
                                "[rank 1] warning: device cuda:1 is not available", "[rank 1] error: failed"]
    assert [str(w.message) for w in shown] == ["a library's own warning"]  # rank 0's alone
    setup_logging(1, 2, all_ranks=True)  # --log-all-ranks: everything, from every rank
    try:
        get_logger().warning("--resume: no checkpoint yet")
    finally:
        setup_logging(0, 1)
    assert capsys.readouterr().out == "[rank 1] warning: --resume: no checkpoint yet\n"


def test_messages_go_to_the_stdout_of_the_moment_not_a_closed_one():
    """Set up while one stdout was current (a notebook cell's capture, a test's), then logged to after it was
    replaced and closed: the message reaches the current stdout, and nothing fails."""
    import contextlib
    import io

    first, second = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(first):
            setup_logging(0, 1)
        first.close()
        with contextlib.redirect_stdout(second):
            get_logger().warning("after the first stream closed")
    finally:
        setup_logging(0, 1)
    assert second.getvalue() == "warning: after the first stream closed\n"
