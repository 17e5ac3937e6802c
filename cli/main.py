"""The `kvtier` command line."""
import click

@click.group()
def main() -> None:
    """kvtier: KV-cache tiers for LLM inference."""
