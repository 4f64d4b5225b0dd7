"""The Megatron-LM benchmark's results (the rows of :func:`automap.bench_megatron.run`): the Markdown
table, the summary line, what each addition changes, the CSV and the plots."""
from __future__ import annotations

import csv
import math
import os

from automap.bench_megatron import MOE_CONFIGS, MOE_MESH

ADDS = (  # (what is added, the config kind, the strategy without it, the strategy with it)
    ("sequence parallelism", "gpt", "megatron_dp", "megatron_dp_sp"),
    ("selective recompute instead of the model's (every layer; tiny: none)", "gpt", "megatron_dp_sp",
     "megatron_dp_sp_selective"),
    ("expert parallelism (instead of Megatron's split experts)", "moe", "megatron_dp", "expert_dp"),
    ("Megatron on the expert axis (embedding, head)", "moe", "expert_dp", "expert_megatron_dp"),
)
COLUMNS = ("config", "params_m", "mesh", "topology", "strategy", "mem_gib", "fits", "coll_mib", "time_ms",
           "xla_mem_gib", "xla_coll_mib", "plan_s", "vs_best_expert", "note", "wire_mib", "xla_wire_mib")


def additions(rows: list[dict]) -> str:
    """A Markdown table of what each addition (:data:`ADDS`) changes, per config, mesh 2x4 and
    the first topology: bytes sent on the wire, memory (estimated; XLA's where compiled) and step."""
    done = [r for r in rows if "time_ms" in r and r["mesh"] == MOE_MESH]
    if not done:
        return ""
    topo0 = done[0]["topology"]
    at = {(r["config"], r["strategy"]): r for r in done if r["topology"] == topo0}
    lines = [f"What each addition changes (mesh {MOE_MESH}, {topo0}; with / without, estimated; XLA where compiled):",
             "", "| addition | config | bytes sent (MiB, wire) | memory (MiB) | step (ms) | XLA bytes sent | XLA memory |",
             "|---|---|---|---|---|---|---|"]
    ratio = lambda a, b: "-" if a is None or b is None or not b else f"{a / b:.3f}x"  # noqa: E731
    for what, kind, without, with_ in ADDS:
        for cfg in dict.fromkeys(c for c, _ in at):
            if (cfg in MOE_CONFIGS) != (kind == "moe") or (cfg, without) not in at or (cfg, with_) not in at:
                continue
            a, b = at[(cfg, with_)], at[(cfg, without)]
            cells = [f"{_fmt(b[k] * scale, '.3f')} -> {_fmt(a[k] * scale, '.3f')} ({ratio(a[k], b[k])})"
                     for k, scale in (("wire_mib", 1), ("mem_gib", 2**10), ("time_ms", 1))]
            cells += [ratio(a[k], b[k]) for k in ("xla_wire_mib", "xla_mem_gib")]
            lines.append(f"| {what}: {without} -> {with_} | {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v, spec=".2f"):
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(rows: list[dict]) -> str:
    head = ("| config | params (M) | mesh (data x model) | topology | strategy | memory/device (GiB, est.) | fits "
            "| collectives/device (MiB, est.) | step (ms, est.) | XLA memory (GiB) | XLA collectives (MiB) "
            "| plan time (s) | time / best expert |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        if "time_ms" not in r:
            fail = r["note"].startswith("FAILED")
            lines.append(f"| {r['config']} | {r['params_m']} | {r['mesh']} | {r['topology']} | {r['strategy']} | "
                         + " | ".join([r["note"]] + ["-"] * 5 + [_fmt(r.get("plan_s"), ".1f"),
                                                                 "fail" if fail else "-"]) + " |")
            continue
        small = r["mem_gib"] < 0.1
        lines.append("| " + " | ".join([
            r["config"], _fmt(r["params_m"], ".1f"), r["mesh"], r["topology"],
            r["strategy"] + (f" ({r['note']})" if r["note"] else ""),
            _fmt(r["mem_gib"], ".4f" if small else ".2f"), _fmt(r["fits"]),
            _fmt(r["coll_mib"], ".3f" if small else ".1f"), _fmt(r["time_ms"], ".3f"),
            _fmt(r["xla_mem_gib"], ".4f"), _fmt(r["xla_coll_mib"], ".3f"), _fmt(r["plan_s"], ".1f"),
            _fmt(r["vs_best_expert"], ".3f")]) + " |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    auto = [r for r in rows if r["strategy"] == "automap_mcts" and r.get("vs_best_expert") is not None]
    failed = [r for r in rows if r["strategy"] == "automap_mcts" and r.get("vs_best_expert") is None]
    if not auto:
        return ""
    ratios = [r["vs_best_expert"] for r in auto]
    wins = sum(x <= 1 + 1e-9 for x in ratios)
    worst = max(auto, key=lambda r: r["vs_best_expert"])
    best = min(auto, key=lambda r: r["vs_best_expert"])
    text = (f"automap (MCTS) / best fitting expert, estimated step time: {wins}/{len(ratios)} cases <= 1.0, "
            f"geometric mean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, best "
            f"{best['vs_best_expert']:.3f} ({best['config']} {best['mesh']} {best['topology']}), worst "
            f"{worst['vs_best_expert']:.3f} ({worst['config']} {worst['mesh']} {worst['topology']})")
    unfit = [r for r in auto if not r["fits"]]
    if unfit:
        text += f"; {len(unfit)} automap plans do not fit the device memory"
    if failed:
        text += (f"; MCTS found no plan within the memory budget in {len(failed)} cases ("
                 + ", ".join(f"{r['config']} {r['mesh']} {r['topology']}" for r in failed) + ")")
    return text + "\n"


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in COLUMNS})


def plots(rows: list[dict], out: str, prefix: str = "megatron") -> list[str]:
    """Three PNGs: memory vs mesh shape, collective bytes per strategy, automap / best expert."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "time_ms" in r]
    topo0 = done[0]["topology"]
    big = max({r["config"]: r["params_m"] for r in done}.items(), key=lambda kv: kv[1])[0]
    meshes = list(dict.fromkeys(r["mesh"] for r in done))
    strategies = list(dict.fromkeys(r["strategy"] for r in done))
    files = []

    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 3, 6, 80 rather than 3x10^0
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    step = 0.6 / max(len(strategies), 1)  # strategies side by side at each mesh: equal values stay visible
    for k, s in enumerate(strategies):
        ys = {r["mesh"]: r["mem_gib"] for r in done if r["config"] == big and r["topology"] == topo0 and r["strategy"] == s}
        xs = [i + (k - (len(strategies) - 1) / 2) * step for i, m in enumerate(meshes) if m in ys]
        marker, line = styles[k % len(styles)]
        ax.plot(xs, [ys[m] for m in meshes if m in ys], marker=marker, ls=line, label=s)
    if done[0]["mem_gib"] > 1:
        ax.axhline(80, color="grey", ls="--", lw=1, label="H100 80 GiB")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if ax.get_ylim()[1] / ax.get_ylim()[0] < 30 else NullFormatter())
    ax.set_xticks(range(len(meshes)), meshes)
    ax.set(xlabel="mesh (data x model)", ylabel="peak memory / device (GiB, estimated)",
           title=f"{big}: memory vs mesh shape")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(os.path.join(out, f"{prefix}_memory.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    mesh0 = "2x4" if "2x4" in meshes else meshes[-1]
    configs = list(dict.fromkeys(r["config"] for r in done))
    # one panel per model: a tiny model's bars would vanish on a GPT-2's scale
    fig, axes = plt.subplots(1, len(configs), figsize=(3.5 * len(configs) + 1, 4), squeeze=False)
    for ax, c in zip(axes[0], configs):
        ys = [next((r["coll_mib"] for r in done if r["config"] == c and r["mesh"] == mesh0 and r["topology"] == topo0
                    and r["strategy"] == s), 0) for s in strategies]
        ax.bar(range(len(strategies)), ys, color=[f"C{i}" for i in range(len(strategies))])
        ax.set_xticks(range(len(strategies)), strategies, rotation=45, ha="right", fontsize=7)
        ax.set(title=c, ylabel="collective MiB / device / step (est.)")
    fig.suptitle(f"collectives per strategy, mesh {mesh0}")
    fig.tight_layout()
    files.append(os.path.join(out, f"{prefix}_collectives.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    auto = [r for r in done if r["strategy"] == "automap_mcts" and r["vs_best_expert"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(auto)), 4))
    labels = [f"{r['config']} {r['mesh']}" + ("" if r["topology"] == topo0 else " 2n") for r in auto]
    ax.bar(range(len(auto)), [r["vs_best_expert"] for r in auto],
           color=["tab:green" if r["vs_best_expert"] <= 1 + 1e-9 else "tab:red" for r in auto])
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(auto)), labels, rotation=70, fontsize=7)
    ax.set(ylabel="step time: automap / best expert", title="automap (MCTS) vs best fitting expert (est.)")
    fig.tight_layout()
    files.append(os.path.join(out, f"{prefix}_automap_vs_experts.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
