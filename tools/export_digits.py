"""Export the UCI optical handwritten digits (as shipped by scikit-learn) to ``src/polytrain/data/digits.npz``.

Run once, in a throwaway environment that has scikit-learn; polytrain itself never imports scikit-learn:

    python -m venv /tmp/skl && /tmp/skl/bin/pip install scikit-learn
    /tmp/skl/bin/python tools/export_digits.py

The file holds ``images`` (uint8, 1797x8x8, values 0..16) and ``labels`` (uint8, 0..9) in scikit-learn's order.
Data: E. Alpaydin and C. Kaynak (1998), UCI Machine Learning Repository, CC BY 4.0.
"""

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parents[1] / "src" / "polytrain" / "data" / "digits.npz"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.uint8)
    assert np.array_equal(images, digits.images), "pixel values are expected to be integers 0..16"
    labels = digits.target.astype(np.uint8)
    np.savez_compressed(OUT, images=images, labels=labels)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {images.shape[0]} images, labels {np.bincount(labels)}")


if __name__ == "__main__":
    main()
