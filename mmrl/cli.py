"""The `mmrl` command line.

    mmrl models                      # registered families, modalities, declared capabilities
    mmrl models --json
    mmrl --plugin my_pkg.models models   # also load an out-of-tree family module
    mmrl train recipes/tiny_vlm_count.yaml [key=value ...]
    torchrun --nproc_per_node 2 -m mmrl.cli train RECIPE [key=value ...]
"""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="RL training for HuggingFace text and vision-language models.",
)
console = Console()


def fail(message: str) -> None:
    """Print a one-line error and exit non-zero."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


@app.callback()
def main(
    plugin: list[str] = typer.Option(
        [], "--plugin", help="Import MODULE first; its @register_model adapters join the registry.",
        metavar="MODULE",
    ),
) -> None:
    from mmrl.registry import RegistryError, load_plugin

    for module in plugin:
        try:
            load_plugin(module)
        except RegistryError as exc:
            fail(str(exc))


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List registered model families with their modalities and declared capabilities."""
    from mmrl.registry import families

    rows = [
        {
            "family": a.family,
            "model_types": list(a.model_types),
            "hf_class": a.hf_class,
            "modalities": list(a.modalities),
            "capabilities": a.capabilities.declared(),
            "vllm_architecture": a.rollout.vllm_architecture,
            "module": type(a).__module__,
        }
        for a in families()
    ]
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title=f"{len(rows)} registered model families")
    for column in ("family", "model types", "modalities", "declared capabilities"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["family"], ", ".join(row["model_types"]), ", ".join(row["modalities"]),
            ", ".join(row["capabilities"]),
        )
    console.print(table)


@app.command()
def train(
    recipe: str = typer.Argument(..., help="A YAML recipe (see recipes/)."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-4"),
) -> None:
    """Train with a recipe; the same command runs one process or, under torchrun, several."""
    from mmrl.config import RecipeError, load_recipe

    try:
        config = load_recipe(recipe, overrides or [])
    except RecipeError as exc:
        fail(str(exc))
    from mmrl.trainer import train as run

    try:
        summary = run(config)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    if summary is not None and int(__import__("os").environ.get("RANK", "0")) == 0:
        console.print_json(json.dumps(summary))


if __name__ == "__main__":
    app()
