"""asyncio for ferry.Transfer: `await transfer` (or transfer_future) ends when the transfer does,
raising its error, without a thread per wait: ferry's callback thread settles the future on
the loop's own thread (call_soon_threadsafe)."""

import asyncio


def transfer_future(transfer, loop=None):
    """An asyncio future of the running loop (or `loop`) that ends with `transfer`: its result
    None, or the transfer's ferry.Error. Cancelling the future leaves the transfer running."""
    loop = loop or asyncio.get_running_loop()
    future = loop.create_future()

    def settle(t):
        if future.done():  # cancelled meanwhile
            return
        if t.error is None:
            future.set_result(None)
        else:
            future.set_exception(t.error)

    transfer.add_done_callback(lambda t: loop.call_soon_threadsafe(settle, t))
    return future
