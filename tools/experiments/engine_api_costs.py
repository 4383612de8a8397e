"""What the torch calls a ferry.deep_ep step makes cost one by one on this GPU (us, median)."""
import statistics, time, torch, ferry
from ferry._engine_api import check_tensor
dev = torch.device("cuda", 0)
T, H, E, K = 128, 2048, 8, 4
x = torch.randn(T, H, device=dev).to(torch.bfloat16)
idx = torch.randint(0, E, (T, K), device=dev)
ones = torch.ones(T, K, device=dev)
s = torch.cuda.Stream()
cur = torch.cuda.current_stream(dev)
b = ferry.CallbackBootstrap(0, 1, lambda d, t: [d])
c = ferry.AllToAllConfig(world_size=1, rank=0, num_experts=E, experts_per_token=K,
                         max_tokens_per_rank=T, hidden=H, device=ferry.MoeDevice.CUDA)
a2a = ferry.AllToAll(c, None, b)
a2a.set_stream(s)
ops = {
    "current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "current_stream()": lambda: torch.cuda.current_stream(),
    "wait_stream": lambda: s.wait_stream(cur),
    "record_stream": lambda: x.record_stream(s),
    "ids.to(int32)": lambda: idx.to(torch.int32),
    "ones[:T]": lambda: ones[:T],
    "check_tensor": lambda: check_tensor("x", x, torch.bfloat16, 2, dev),
    "poll": lambda: a2a.poll(),
    "is_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    "Event+record": lambda: torch.cuda.Event().record(s),
    "as_array": lambda: ferry.as_array(x),
}
for name, f in ops.items():
    for _ in range(200):
        f()
    t = []
    for _ in range(3000):
        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{name:22} {statistics.median(t) * 1e6:7.2f}")

# The same step through ferry.deep_ep, profiled: where a low-latency dispatch and combine's
# time goes, call by call.
import cProfile, pstats  # noqa: E402
from ferry import deep_ep  # noqa: E402
buf = deep_ep.Buffer(b, ranks_per_node=1, explicitly_destroy=True)
w = torch.rand(T, K, device=dev)
with torch.cuda.stream(s):
    for _ in range(50):
        r, _, h, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        buf.low_latency_combine(r, idx, w, h)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(1000):
        r, _, h, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        buf.low_latency_combine(r, idx, w, h)
        torch.cuda.synchronize()
    profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(22)
