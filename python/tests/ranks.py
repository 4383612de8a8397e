"""Runs a test body in forked ranks (ferry.run_local_ranks) and fails the test if any rank did."""

import ferry


def run_ranks(test, world_size, body, timeout=60.0):
    """body(bootstrap) in world_size ranks; a rank that raises prints its traceback and exits 1."""
    exits = ferry.run_local_ranks(world_size, body, timeout)
    failed = {rank: e for rank, e in enumerate(exits) if not e.ok}
    test.assertEqual(failed, {}, "ranks that failed (their tracebacks are on stderr)")


def shm_engine():
    return ferry.TransferEngine(ferry.EngineOptions.from_env(provider="shm"))


def expect_error(error, text, call, *args, **kwargs):
    """call(*args, **kwargs) must raise `error` with `text` in its message (inside a rank, where
    unittest's assertRaises is not at hand)."""
    try:
        call(*args, **kwargs)
    except error as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"{getattr(call, '__name__', call)} did not raise {error.__name__} "
                         f"({text})")
