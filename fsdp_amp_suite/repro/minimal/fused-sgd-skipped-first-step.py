import torch

torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty* is NaN-filled: no luck involved
c = torch.tensor([0.25, 0.5, -1.0])  # the exact grad of w in loss = <w, c>
w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
opt = torch.optim.SGD([w], lr=0.5, momentum=0.9, fused=True)
scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
for step in range(2):
    opt.zero_grad()
    scaler.scale((w * c).sum()).backward()
    if step == 0:
        w.grad[1] = float("inf")  # the first step overflows and is skipped
    scaler.step(opt)
    scaler.update()
want = torch.tensor([0.5, -0.25, 1.0]) - 0.5 * c  # one step from a momentum buffer made of that grad
print(f"observed: w after a skipped step and a clean one {w.detach().tolist()}")
print(f"expected: {want.tolist()}")
raise SystemExit(0 if torch.equal(w.detach(), want) else 1)
