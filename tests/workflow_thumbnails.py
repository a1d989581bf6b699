"""Thumbnails for the template browser: ``example_workflows/<name>.jpg`` beside each ``<name>.json``.

ComfyUI's template browser asks for ``/api/workflow_templates/<pack>/<name>.jpg``; each thumbnail is a
drawing of that workflow's own graph (its nodes where the workflow places them, the pack's nodes in
the pack's orange, the links between them), so it shows what the template does.

    python tests/workflow_thumbnails.py        # rewrites every thumbnail (matplotlib + Pillow)
"""
import glob
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "example_workflows")
SIZE = (512, 384)


def draw(workflow: dict, title: str):
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import FancyBboxPatch
    nodes = [n for n in workflow.get("nodes", []) if n.get("type") != "MarkdownNote"]
    fig = Figure(figsize=(SIZE[0] / 100, SIZE[1] / 100), dpi=100, facecolor="#1e1e1e")
    FigureCanvasAgg(fig)
    ax = fig.add_axes([0.02, 0.02, 0.96, 0.86])
    ax.set_facecolor("#1e1e1e")
    ax.set_axis_off()
    boxes = {}
    for n in nodes:
        x, y = n.get("pos", [0, 0])[:2]
        w, h = (n.get("size") or [200, 100])[:2]
        boxes[n["id"]] = (x, y, w, h)
        ours = str(n.get("type", "")).startswith("FluxNumba")
        ax.add_patch(FancyBboxPatch((x, -y - h), w, h, boxstyle="round,pad=4", linewidth=1,
                                    facecolor="#e8743b" if ours else "#3a3f47", edgecolor="#ddd" if ours else "#777"))
        ax.text(x + w / 2, -y - h / 2, str(n.get("title") or n.get("type")).replace("FluxNumba", "FluxNumba\n"),
                ha="center", va="center", fontsize=6, color="white", wrap=True)
    for link in workflow.get("links", []):
        if isinstance(link, list) and len(link) >= 5 and link[1] in boxes and link[3] in boxes:
            sx, sy, sw, sh = boxes[link[1]]
            tx, ty, tw, th = boxes[link[3]]
            ax.plot([sx + sw, tx], [-sy - sh / 2, -ty - th / 2], color="#8a8f98", linewidth=0.6, alpha=0.7)
    if boxes:
        xs = [b[0] for b in boxes.values()] + [b[0] + b[2] for b in boxes.values()]
        ys = [-b[1] for b in boxes.values()] + [-b[1] - b[3] for b in boxes.values()]
        ax.set_xlim(min(xs) - 30, max(xs) + 30)
        ax.set_ylim(min(ys) - 30, max(ys) + 30)
    fig.text(0.5, 0.94, title, ha="center", va="center", fontsize=11, color="#e8743b", weight="bold")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor=fig.get_facecolor())
    from PIL import Image
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def main():
    for path in sorted(glob.glob(os.path.join(FOLDER, "*.json"))):
        name = os.path.splitext(os.path.basename(path))[0]
        img = draw(json.load(open(path)), name.replace("_", " "))
        out = os.path.join(FOLDER, name + ".jpg")
        img.save(out, quality=85)
        print(out)


if __name__ == "__main__":
    sys.exit(main())
