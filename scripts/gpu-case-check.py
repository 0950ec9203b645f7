"""On the GPU machine: writes a random case file (safetensors, via torch), runs kda-run --case on the
CPU and on CUDA, and prints the relative error between them and against an fp64 recurrence."""
import subprocess, sys, torch
from safetensors.torch import save_file, load_file

kda_run, tmp = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
lengths = [0, 1, 37, 300, 16]
T, H, D = sum(lengths), 4, 128
bf = lambda *s: torch.randn(*s).to(torch.bfloat16)
t = {"q": bf(1, T, H, D), "k": bf(1, T, H, D), "v": bf(1, T, H, D), "g": bf(1, T, H, D), "beta": bf(1, T, H),
     "A_log": torch.rand(H).add(0.5).log(), "dt_bias": torch.rand(H, D) * 2 - 1,
     "initial_state": torch.randn(len(lengths), H, D, D) * 0.5,
     "cu_seqlens": torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)}
save_file(t, f"{tmp}/case.safetensors", metadata={"gate": "softplus", "final_state": "f32"})
outs = {}
for be in ("cpu", "cuda"):
    r = subprocess.run([kda_run, "--case", f"{tmp}/case.safetensors", "--output", f"{tmp}/out-{be}.safetensors",
                        "--backend", be], capture_output=True, text=True)
    print(be, "rc", r.returncode, r.stdout.strip().splitlines()[-1:] , r.stderr.strip()[-300:])
    outs[be] = load_file(f"{tmp}/out-{be}.safetensors")

def ref():  # fp64 recurrence, KDA.md §1
    q, k, v, g, beta = (t[n].double() for n in ("q", "k", "v", "g", "beta"))
    out = torch.zeros(1, T, H, D, dtype=torch.float64); S_all = t["initial_state"].double().clone()
    cu = t["cu_seqlens"].tolist()
    for s in range(len(lengths)):
        for h in range(H):
            S = S_all[s, h].T.clone()  # K x V
            for i in range(cu[s], cu[s + 1]):
                qi = q[0, i, h] / (q[0, i, h].square().sum() + 1e-6).sqrt()
                ki = k[0, i, h] / (k[0, i, h].square().sum() + 1e-6).sqrt()
                x = g[0, i, h] + t["dt_bias"][h].double()
                gg = -t["A_log"][h].double().exp() * torch.nn.functional.softplus(x)
                S = gg.exp()[:, None] * S
                b = torch.sigmoid(beta[0, i, h])
                S = S + b * torch.outer(ki, v[0, i, h] - S.T @ ki)
                out[0, i, h] = D ** -0.5 * (S.T @ qi)
            S_all[s, h] = S.T
    return out, S_all

o_ref, s_ref = ref()
rel = lambda x, y: ((x.double() - y).norm() / y.norm()).item()
for be in ("cpu", "cuda"):
    print(f"kda-run --case --backend {be}: out vs fp64 {rel(outs[be]['out'], o_ref):.2e}, "
          f"final_state vs fp64 {rel(outs[be]['final_state'], s_ref):.2e}")
print(f"cuda vs cpu: out {rel(outs['cuda']['out'], outs['cpu']['out'].double()):.2e}")
