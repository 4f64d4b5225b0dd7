"""Command line: ``python -m automap demo [--layers N] [--scan] [--nnx]`` and
``python -m automap bench megatron [--quick] [--out DIR]``."""
import sys

BENCHMARKS = {"megatron": "automap.bench_megatron"}


def main(argv: list[str]) -> int:
    commands = {"demo": "automap.demo", "bench": None}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m automap {{{','.join(commands)}}} [options]")
        return 2
    import importlib

    if argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: python -m automap bench {{{','.join(BENCHMARKS)}}} [options]")
            return 2
        return importlib.import_module(BENCHMARKS[argv[1]]).main(argv[2:])
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
