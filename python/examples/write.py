"""Two ranks on this machine (libfabric's shm provider): rank 0 writes into rank 1's buffer,
and the immediate that travels behind the bytes tells rank 1 they have landed."""

import ferry


def rank(bootstrap):
    engine = ferry.TransferEngine(ferry.EngineOptions.from_env(provider="shm"))
    buf = bytearray(4096)
    region = engine.register(buf)
    addresses = bootstrap.all_gather(engine.address)
    regions = bootstrap.all_gather(region.descriptor)
    peer = engine.add_peer(addresses[1 - bootstrap.rank])
    engine.create_imm_counter(1)
    bootstrap.barrier()
    if bootstrap.rank == 0:
        buf[:5] = b"hello"
        engine.write(region, peer, regions[1], length=5, imm=1).wait(timeout=10)
    else:
        engine.wait_imm(1, 1, timeout=10)
        print("rank 1 received", bytes(buf[:5]))
        assert bytes(buf[:5]) == b"hello"
    bootstrap.barrier()
    engine.close()


if __name__ == "__main__":
    exits = ferry.run_local_ranks(2, rank, timeout=60)
    raise SystemExit(0 if all(e.ok for e in exits) else 1)
