"""Fails unless the installed versions are exactly the given pins.

Run after `pip install .` into an environment that already held them (a
user's TensorFlow, e.g. Colab's): keras-hetero must keep what is there.

    python .ci/check_versions.py tensorflow==2.19.1 keras==3.10.0
"""

import importlib.metadata
import sys


def main(pins):
    wrong = []
    for pin in pins:
        name, _, wanted = pin.partition("==")
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != wanted:
            wrong.append(f"{name}: wanted {wanted}, installed {installed}")
        else:
            print(f"{name}=={installed} kept")
    if wrong:
        sys.exit("versions changed by the install:\n  " + "\n  ".join(wrong))


if __name__ == "__main__":
    main(sys.argv[1:])
