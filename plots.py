"""Curves and an episode viewer for a run: one command, no server, no network.

    python plots.py out            # -> out/curves.png and out/report.html

curves.png: training and held-out success, valid ratio, entropy, KL to the reference, seconds per
phase, tokens trained on, against the iteration (from metrics.jsonl, matplotlib). report.html: one
self-contained page with the curves and the recorded episodes (episodes.jsonl, written by
train.py: see records.py). Pick an iteration and split; each episode group shows its trajectories
side by side, one cell per step coloured by its advantage (green > 0, red < 0, grey: evaluation,
no advantage); click a step to highlight every step of the same anchor state (GiGPO's step group)
and to read its prompt and response. The page embeds the last --max_episodes episodes.
"""

import argparse
import base64
import json
import os
import sys

PANELS = [  # (title, metric keys)
    ("success", ["success", "eval_success", "won_group_frac"]),
    ("valid ratio", ["valid_ratio"]),
    ("entropy", ["entropy"]),
    ("KL to reference", ["kl_ref"]),
    ("seconds per phase", ["time_gen", "time_env", "time_update", "time_sync"]),
    ("tokens trained on", ["tokens"]),
]


def read_jsonl(path):
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line a crash cut short: skip it
            pass
    return rows


def curves_png(metrics, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(m["iteration"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
            if pts:
                ax.plot(
                    *zip(*pts),
                    label=key if key != "eval_success" else "eval_success (last evaluation)",
                    drawstyle="steps-post" if key == "eval_success" else "default",
                )
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report_html(png_path, episodes, title):
    png = base64.b64encode(open(png_path, "rb").read()).decode()
    data = json.dumps(episodes).replace("</", "<\\/")
    return PAGE.replace("__TITLE__", title).replace("__PNG__", png).replace("__DATA__", data)


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("out_dir", help="a train.py --out_dir (holds metrics.jsonl, and episodes.jsonl)")
    ap.add_argument(
        "--max_episodes", type=int, default=400, help="newest episodes embedded in the page (0: none)"
    )
    args = ap.parse_args(argv)
    if args.max_episodes < 0:
        sys.exit(f"error: --max_episodes {args.max_episodes}: give 0 or more (0: no episodes in the page)")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        sys.exit(f"error: no {metrics_path}: give the --out_dir of a train.py run")
    metrics = read_jsonl(metrics_path)
    if not metrics:
        sys.exit(f"error: {metrics_path} holds no complete line yet")
    ep_path = os.path.join(args.out_dir, "episodes.jsonl")
    episodes = read_jsonl(ep_path) if os.path.isfile(ep_path) else []
    episodes = episodes[max(0, len(episodes) - args.max_episodes) :]  # the newest ([-0:] would be all)
    png = os.path.join(args.out_dir, "curves.png")
    curves_png(metrics, png)
    html = os.path.join(args.out_dir, "report.html")
    with open(html, "w") as f:
        f.write(report_html(png, episodes, os.path.abspath(args.out_dir)))
    print(f"wrote {png} and {html} ({len(metrics)} iterations, {len(episodes)} episodes)")


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>gigpo run: __TITLE__</title>
<style>
body { font: 13px sans-serif; margin: 16px; }
.group { border: 1px solid #ccc; margin: 10px 0; padding: 6px; }
.trajs { display: flex; gap: 6px; overflow-x: auto; }
.episode { min-width: 120px; }
.episode h4 { margin: 2px 0; font-size: 12px; }
.step { padding: 2px 4px; margin: 1px 0; border-radius: 3px; cursor: pointer; white-space: nowrap; }
.step.hl { outline: 3px solid #1f4fd8; }
#detail {
  white-space: pre-wrap; background: #f6f6f6; padding: 8px; font-family: monospace;
  max-height: 260px; overflow: auto;
}
</style></head><body>
<h2>gigpo run: __TITLE__</h2>
<img src="data:image/png;base64,__PNG__" alt="curves" style="max-width: 100%">
<h3>Episodes</h3>
<p>Iteration / split: <select id="pick"></select> <span id="count"></span></p>
<p>Cell: step, action, reward, advantage. Colour: advantage (green above 0, red below, grey none).
Click a step: its anchor group (same state, same episode group) is outlined and its prompt shown.</p>
<div id="detail">(click a step)</div>
<div id="groups"></div>
<script>
const EPISODES = __DATA__;
window.errors = [];
window.onerror = (m) => {
  window.errors.push(String(m)); document.body.dataset.errors = window.errors.length;
};
function colour(a) {
  if (a === undefined || a === null) return "#e4e4e4";
  const t = Math.min(1, Math.abs(a) / 1.0), c = Math.round(255 - 150 * t);
  return a >= 0 ? `rgb(${c},255,${c})` : `rgb(255,${c},${c})`;
}
function show(key) {
  const [it, split] = key.split("|");
  const eps = EPISODES.filter(e => String(e.iteration) === it && e.split === split);
  const groups = {};
  for (const e of eps) (groups[e.group] = groups[e.group] || []).push(e);
  const root = document.getElementById("groups");
  root.innerHTML = "";
  for (const [g, list] of Object.entries(groups)) {
    const box = document.createElement("div"); box.className = "group";
    box.innerHTML = `<b>episode group ${g}</b> (${list.length} trajectories)`;
    const row = document.createElement("div"); row.className = "trajs";
    for (const e of list) {
      const col = document.createElement("div"); col.className = "episode";
      col.innerHTML = `<h4>traj ${e.traj}: return ${e.return.toFixed(2)}, ${e.length} steps</h4>`;
      for (const s of e.steps) {
        const d = document.createElement("div"); d.className = "step";
        d.style.background = colour(s.adv);
        d.dataset.anchor = g + "|" + (s.step_group !== undefined ? s.step_group : s.anchor);
        d.textContent = `${s.step}: ${s.action || "(invalid)"} r=${s.reward.toFixed(2)}` +
          (s.adv !== undefined ? ` A=${s.adv.toFixed(2)}` : "");
        d.onclick = () => {
          document.querySelectorAll(".step.hl").forEach(x => x.classList.remove("hl"));
          document.querySelectorAll(".step").forEach(x => {
            if (x.dataset.anchor === d.dataset.anchor) x.classList.add("hl");
          });
          const parts = s.adv !== undefined
            ? `\nA^E ${s.adv_episode.toFixed(3)}  A^S ${s.adv_step.toFixed(3)}  ` +
              `A ${s.adv.toFixed(3)}  step return ${s.step_return.toFixed(3)}  ` +
              `step group size ${s.step_group_size}`
            : "";
          document.getElementById("detail").textContent =
            `anchor: ${s.anchor}${parts}\nvalid: ${s.valid}\n\n` +
            `PROMPT\n${s.prompt}\n\nRESPONSE\n${s.response}`;
        };
        col.appendChild(d);
      }
      row.appendChild(col);
    }
    box.appendChild(row); root.appendChild(box);
  }
  document.getElementById("count").textContent = `${eps.length} episodes`;
  document.body.dataset.shown = eps.length;
}
const keys = [...new Set(EPISODES.map(e => e.iteration + "|" + e.split))];
const pick = document.getElementById("pick");
for (const k of keys) {
  const o = document.createElement("option"); o.value = k; o.textContent = k.replace("|", " / ");
  pick.appendChild(o);
}
pick.onchange = () => show(pick.value);
const train = keys.filter(k => k.endsWith("|train"));   // start on the newest training iteration
if (keys.length) {
  pick.value = (train.length ? train : keys)[(train.length ? train : keys).length - 1]; show(pick.value);
}
else { document.body.dataset.shown = 0; }
document.body.dataset.ready = "1";
</script></body></html>
"""

if __name__ == "__main__":
    main()
