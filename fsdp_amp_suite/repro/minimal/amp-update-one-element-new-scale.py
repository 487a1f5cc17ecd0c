import torch

scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
w = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([w], lr=0.1)
scaler.scale(w.sum()).backward()
scaler.step(opt)
try:  # update() asserts "a 1-element torch.cuda.FloatTensor or torch.FloatTensor": this is one
    scaler.update(new_scale=torch.tensor([1024.0]))
    print(f"observed: scale {scaler.get_scale()}")
except RuntimeError as exc:
    print(f"observed: RuntimeError: {exc}")
print("expected: scale 1024.0")
raise SystemExit(0 if scaler.get_scale() == 1024.0 else 1)
