"""The front door tells the truth: the README's "What is here" table and the crate
layout of docs/architecture.md name exactly the folders of the tree and the members of
the workspace, and no crate's modules depend on each other in a circle
(tools/module_cycles.py, which is shown to catch one)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CYCLES = ROOT / "tools" / "module_cycles.py"


def workspace_members():
    manifest = (ROOT / "Cargo.toml").read_text()
    members = re.search(r"members\s*=\s*\[(.*?)\]", manifest, re.S).group(1)
    return set(re.findall(r'"([^"]+)"', members))


def top_folders():
    """The tracked top-level folders (hidden ones, like .ci, left out)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {path.split("/")[0] for path in listed if "/" in path and not path.startswith(".")}


def table_paths(text, heading):
    """The `path/` cells opening the rows of the first table after `heading`."""
    section = text[text.index(heading):]
    table = re.search(r"\n(\|.*\|\n)+", section).group(0)
    return {m.rstrip("/") for m in re.findall(r"^\| `([^`]+)` \|", table, re.M)}


def test_the_readme_lists_every_top_folder_and_nothing_else():
    listed = table_paths((ROOT / "README.md").read_text(), "## What is here")
    assert listed == top_folders(), (
        f"README 'What is here' lists {sorted(listed)}, the tree has {sorted(top_folders())}"
    )


def test_the_architecture_crate_layout_lists_every_workspace_member():
    listed = table_paths((ROOT / "docs" / "architecture.md").read_text(), "## Crate layout")
    missing = workspace_members() - listed
    assert not missing, f"docs/architecture.md's crate layout misses {sorted(missing)}"
    folders = {path.split("/")[0] for path in listed}
    assert folders <= top_folders(), f"it names folders that do not exist: {sorted(folders - top_folders())}"


def test_no_crate_has_a_module_circle():
    run = module_cycles(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def module_cycles(workspace):
    """tools/module_cycles.py run on `workspace`."""
    return subprocess.run(
        [sys.executable, str(CYCLES), str(workspace)], capture_output=True, text=True
    )


def make_crate(root, files):
    (root / "Cargo.toml").write_text('[workspace]\nmembers = ["demo"]\n')
    src = root / "demo" / "src"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_circle_check_catches_a_circle_through_a_child_module(tmp_path):
    make_crate(
        tmp_path,
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::Thing;\npub struct Other;\n",
            "b/mod.rs": "mod inner;\npub struct Thing;\npub fn f() {\n    inner::g()\n}\n",
            "b/inner.rs": "// crate::b in a comment is no edge\nuse crate::a::Other;\npub fn g() {}\n",
        },
    )
    run = module_cycles(tmp_path)
    assert run.returncode == 1, run.stdout
    assert "modules in a circle: a, b, b::inner" in run.stdout, run.stdout
    assert "a -> b\n" in run.stdout, run.stdout
    assert "b -> b::inner" in run.stdout and "b::inner -> a" in run.stdout, run.stdout


def test_the_circle_check_leaves_tests_and_reexports_alone(tmp_path):
    make_crate(
        tmp_path,
        {
            "lib.rs": "mod a;\nmod b;\npub use a::Other;\n",
            "a.rs": "pub struct Other;\n#[cfg(test)]\nmod tests {\n    use crate::b::Thing;\n}\n",
            "b.rs": "use crate::a::Other;\npub struct Thing;\n",
        },
    )
    run = module_cycles(tmp_path)
    assert run.returncode == 0, run.stdout


def test_the_performance_page_is_short_and_its_figures_reproduce(tmp_path):
    page = (ROOT / "docs" / "performance.md").read_text()
    assert len(page.splitlines()) <= 400
    plots = re.findall(r"\]\((perf/[^)]+\.svg)\)", page)
    assert plots, "no plot on the performance page"
    for plot in plots:
        assert (ROOT / "docs" / plot).is_file(), plot
    kept = sorted((ROOT / "docs" / "perf").glob("*.json"))[-1]
    out = tmp_path / "again"
    subprocess.run(
        [sys.executable, str(ROOT / "benches" / "plot_compare.py"), "--json", str(kept), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    tables = (tmp_path / "again.md").read_text()
    assert tables.strip() in page, "the page's tables are not what the kept figures give"
    for plot in plots:
        if kept.stem in plot:
            mode = plot.rsplit("-", 1)[1]
            redrawn = (tmp_path / f"again-{mode}").read_text()
            assert redrawn == (ROOT / "docs" / plot).read_text(), plot
