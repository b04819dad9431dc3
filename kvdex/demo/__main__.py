"""``python -m kvdex.demo``: the same command as ``kvdex demo``."""

import argparse

import kvdex.demo
from kvdex.demo.cli import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m kvdex.demo", description=kvdex.demo.__doc__.split("\n")[0])
add_arguments(parser)
raise SystemExit(main(parser.parse_args()))
