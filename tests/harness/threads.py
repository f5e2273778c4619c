"""Ranks as threads of the test process, for tests of the Communicator itself."""

import threading


def on_threads(fn, world, deadline_s=60.0):
    """``fn(rank)`` on ``world`` threads at once; their results in rank order.

    Every join is bounded by ``deadline_s``; a rank still running then fails the test, and
    the first exception a rank raised is re-raised in the caller's thread.
    """
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s)
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return results
