"""python -m qie.tiny PRESET OUT_DIR: write one of qie's tiny random models (each model family names its
presets: edit, edit_plus, edit_2511, t2i, demo, qwen_image_21, qwen_image_layered, demo_layered, ...) as a diffusers
folder, e.g. to try a command offline with `model.pretrained_model_name_or_path=OUT_DIR`."""

from __future__ import annotations

import argparse

from qie.components.tiny import build_tiny_model
from qie.models import tiny_presets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qie.tiny", description=__doc__.split(":")[0])
    parser.add_argument("preset", choices=sorted(tiny_presets()), help="which tiny model")
    parser.add_argument("out_dir", help="folder to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    args = parser.parse_args(argv)
    print(f"tiny: wrote {build_tiny_model(args.out_dir, args.preset, args.seed)}")


if __name__ == "__main__":
    main()
