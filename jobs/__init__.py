"""Command-line entry points: argparse -> dataclass -> library call."""
