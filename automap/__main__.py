"""Command line: ``python -m automap {demo,bench} [options]``; ``--help`` lists the commands."""
import sys

BENCHMARKS = {"megatron": "automap.bench_megatron"}
COMMANDS = {
    "demo": ("automap.demo", "a GPT train step on 8 simulated CPU devices: three plans, their reports, "
             "what XLA compiled, the loss against the unsharded step [--layers N] [--scan] [--nnx]"),
    "bench": (None, "benchmarks: 'bench megatron [--quick] [--out DIR]' (GPT-2 shapes, estimated; writes to "
              "a fresh directory unless --out is given)"),
}


def usage() -> str:
    lines = ["usage: python -m automap COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<7} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "python -m automap COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage())
        return 2
    import importlib

    if argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: python -m automap bench {{{','.join(BENCHMARKS)}}} [options]")
            return 2
        return importlib.import_module(BENCHMARKS[argv[1]]).main(argv[2:])
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
