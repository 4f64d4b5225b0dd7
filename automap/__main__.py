"""Command line: ``python -m automap demo [--layers N] [--scan] [--nnx]``."""
import sys


def main(argv: list[str]) -> int:
    commands = {"demo": "automap.demo"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m automap {{{','.join(commands)}}} [options]")
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
