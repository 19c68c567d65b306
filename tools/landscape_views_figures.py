"""Regenerate the README's trajectory-PCA and mode-connectivity figures from the demo zoo.

    python tools/landscape_views_figures.py DEMO_DIR [IMG_DIR]

DEMO_DIR is a demo zoo (``flatcli demo -o DEMO_DIR`` or `flatcli.demo.train_zoo`; trained
here when it has no config.yaml); IMG_DIR defaults to docs/img. The same through the CLI:

    python -m flatcli.demo.trajectory DEMO_DIR mlp_w256_wd0_noise0 5
    flatcli landscape pca 'DEMO_DIR/trajectory/mlp_w256_wd0_noise0/step_*.pt' \\
        -c DEMO_DIR/config.yaml -o DEMO_DIR/landscape_pca
    flatcli landscape connect DEMO_DIR/checkpoints/mlp_w256_wd0_noise0.pt \\
        DEMO_DIR/checkpoints/mlp_w256_wd0.0001_noise0.pt -c DEMO_DIR/config.yaml -o DEMO_DIR/landscape_connect
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from flatcli import api
from flatcli.demo import train_trajectory, train_zoo

TRAJECTORY_MODEL, EVERY = "mlp_w256_wd0_noise0", 5
PAIR = ("mlp_w256_wd0_noise0", "mlp_w256_wd0.0001_noise0")  # clean labels, weight decay 0 and 1e-4


def main(demo: Path, img: Path) -> None:
    cfg = demo / "config.yaml"
    if not cfg.exists():
        train_zoo(demo)
    t0 = time.perf_counter()
    train_trajectory(demo, TRAJECTORY_MODEL, every=EVERY)
    t1 = time.perf_counter()
    pca = api.landscape(
        cfg,
        str(demo / "trajectory" / TRAJECTORY_MODEL / "step_*.pt"),
        "pca",
        outdir=demo / "landscape_pca",
    )
    t2 = time.perf_counter()
    a, b = (demo / "checkpoints" / f"{n}.pt" for n in PAIR)
    con = api.landscape(cfg, [a, b], "connect", outdir=demo / "landscape_connect")
    t3 = time.perf_counter()
    img.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pca.files["plot"], img / "landscape_pca_trajectory.png")
    shutil.copyfile(con.files["plot"], img / "landscape_connect.png")
    print(f"trajectory training {t1 - t0:.1f}s, pca {t2 - t1:.1f}s, connect {t3 - t2:.1f}s")
    for k, v in {**pca.summary, **pca.meta["evaluator"]["train"]}.items():
        print(f"  pca {k}: {v}")
    print(f"  pca checkpoints {len(pca.meta['checkpoints'])}, grid {pca.surface.train_loss.shape}")
    for k, v in con.summary.items():
        print(f"  connect {k}: {v}")
    print(f"  connect fit loss {con.meta['fit_loss_first']:.4g} -> {con.meta['fit_loss_last']:.4g}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else Path("docs/img"))
