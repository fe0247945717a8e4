"""MkDocs hook: the committed plots (`results/**/*.png`) join the site under the same relative path.

So a page shows one as `![caption](results/headline/x.png)`, the build copies it, and `mkdocs build --strict` fails
on a link to a plot that does not exist, as on any other broken link.
"""

from pathlib import Path

from mkdocs.structure.files import File

REPOSITORY = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for plot in sorted((REPOSITORY / "results").rglob("*.png")):
        files.append(File.generated(config, plot.relative_to(REPOSITORY).as_posix(), abs_src_path=str(plot)))
    return files
