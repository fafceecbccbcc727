import time, statistics, torch
a = [torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")]
b = [torch.ones(1, 1, dtype=torch.long, device="cuda"), torch.ones(1, dtype=torch.long, device="cuda")]
def two():
    for d, s in zip(a, b): d.copy_(s)
def one():
    torch._foreach_copy_(a, b)
res = {}
for name, fn in (("two copy_", two), ("one _foreach_copy_", one)) * 2:
    for _ in range(200): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(50):
        t = time.perf_counter_ns()
        for _ in range(100): fn()
        ts.append((time.perf_counter_ns() - t) / 100 / 1e3)
        torch.cuda.synchronize()
    res[name] = round(statistics.median(ts), 2)
print("host us a call:", res)
