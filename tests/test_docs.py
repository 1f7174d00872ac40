"""The user docs say what the code does: the README stays short, every relative link resolves, and
every setting, default, metric, command-line flag and preset the docs name is one the code has."""

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest
from voxtriton_client import cli as client_cli

from voxtriton import cli
from voxtriton.launch.repository import model_configs, read_parameters
from voxtriton.serving.settings import CodecSettings, TTSSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "docker" / "README.md",
    *sorted((ROOT / "benchmarks").glob("**/README.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", flags=re.S)
METRIC = re.compile(r"\bvoxtriton_[a-z0-9_]+")
MODEL_KEY = re.compile(r"(?<![\w-])(tts|codec_urgent|codec_background|\*):([a-z_][a-z0-9_]*)")
COMMAND = re.compile(r"\b(voxtriton(?:-client)?) ((?:[a-z][a-z-]*)(?: (?:add|list|delete))?)")
SHELL_END = r" \| |[&;#>]"  # where a command in a code line ends (`a|b` lists alternatives, not a pipe)
COMMANDS = {("voxtriton", sub) for sub in ("serve", "gateway", "voices", "make-checkpoint")} | {
    ("voxtriton-client", "speak")
}
BY_PATH = {"ids": lambda path: str(path.relative_to(ROOT))}


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", markdown.read_text())  # a `#` line in a code block is no heading
    headings = re.findall(r"^#+\s+(.*)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def relative_links(markdown: Path) -> list[str]:
    text = FENCE.sub("", markdown.read_text())  # links in code are not links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def command_lines(markdown: Path) -> list[str]:
    """The text of every inline code span and every fenced line (a trailing backslash continues it)."""
    text = markdown.read_text()
    fenced = "\n".join(FENCE.findall(text)).replace("\\\n", " ")
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text).replace("\n", " "))
    return fenced.splitlines() + spans


def test_readme_is_at_most_10_kb():
    assert (ROOT / "README.md").stat().st_size <= 10240


@pytest.mark.parametrize("markdown", DOCS, **BY_PATH)
def test_relative_links_resolve(markdown):
    broken = []
    for link in relative_links(markdown):
        path, _, anchor = link.partition("#")
        target = (markdown.parent / path).resolve() if path else markdown
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor}")
    assert not broken, f"{markdown.relative_to(ROOT)}: " + "; ".join(broken)


def settings() -> dict[str, dict[str, object]]:
    """Each packaged model's settings as it loads them: the defaults with its config.pbtxt applied."""
    loaded = {}
    for model, config in model_configs(ROOT / "model_repository").items():
        parameters = {
            "parameters": {k: {"string_value": v} for k, v in read_parameters(config.read_text()).items()}
        }
        if model == "tts":
            tts, scheduler = TTSSettings.from_model_config(parameters)
            values = dataclasses.asdict(tts)
            values.update({"scheduler_" + k: v for k, v in dataclasses.asdict(scheduler).items()})
        else:
            values = dataclasses.asdict(CodecSettings.from_model_config(parameters))
        loaded[model] = values
    return loaded


@pytest.mark.parametrize("markdown", DOCS, **BY_PATH)
def test_model_parameters_named_in_the_docs_exist(markdown):
    """`tts:KEY`, `codec_urgent:KEY`, `*:KEY` (as in `--param tts:KEY=VALUE`) name real settings."""
    known = settings()
    unknown = []
    for model, key in MODEL_KEY.findall(markdown.read_text()):
        models = list(known) if model == "*" else [model]
        if not all(key in known[name] for name in models):
            unknown.append(f"{model}:{key}")
    assert not unknown, f"{markdown.relative_to(ROOT)}: not settings: {', '.join(sorted(set(unknown)))}"


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(keys, defaults) of each settings-table row: `a` / `b` | x / y pairs up, a single x applies to all."""
    rows = []
    for first, second in re.findall(r"^\| (`[a-z_0-9]+`(?: / `[a-z_0-9]+`)*) \| ([^|]*) \|", text, re.M):
        rows.append((re.findall(r"`([a-z_0-9]+)`", first), [v.strip() for v in second.split(" / ")]))
    return rows


def same(documented: str, value) -> bool:
    text = "" if documented == '""' else documented
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        return float(text) == value
    return text == value


@pytest.mark.parametrize("markdown", [ROOT / "docs" / "configuration.md", ROOT / "README.md"], **BY_PATH)
def test_settings_tables_give_the_defaults_the_models_load(markdown):
    """Every key of a settings table is a setting and its default column is the value it loads with;
    docs/configuration.md lists every setting of every model."""
    loaded = settings()
    text = markdown.read_text()
    tts_part, _, codec_part = text.partition("## `codec_urgent` and `codec_background`")
    wrong, listed = [], {"tts": set(), "codec": set()}
    for part, models in ((tts_part, ["tts"]), (codec_part, ["codec_urgent", "codec_background"])):
        for keys, defaults in table_rows(part):
            listed["tts" if models == ["tts"] else "codec"].update(keys)
            for i, key in enumerate(keys):
                if len(defaults) == len(keys):
                    expected = {model: defaults[i] for model in models}
                elif len(defaults) == len(models):
                    expected = dict(zip(models, defaults))
                else:
                    expected = {model: defaults[0] for model in models}
                for model, documented in expected.items():
                    if key not in loaded[model]:
                        wrong.append(f"{key}: not a setting of {model}")
                    elif not same(documented, loaded[model][key]):
                        wrong.append(f"{model}:{key} default {documented}, loads {loaded[model][key]!r}")
    if markdown.name == "configuration.md":
        wrong += [f"tts:{key} not documented" for key in sorted(set(loaded["tts"]) - listed["tts"])]
        wrong += [
            f"codec:{key} not documented" for key in sorted(set(loaded["codec_urgent"]) - listed["codec"])
        ]
    assert not wrong, "; ".join(wrong)


def defined_metrics() -> set[str]:
    source = (ROOT / "voxtriton" / "serving" / "triton_metrics.py").read_text()
    return set(re.findall(r'"(voxtriton_[a-z0-9_]+)"', source))


@pytest.mark.parametrize("markdown", DOCS, **BY_PATH)
def test_metrics_named_in_the_docs_exist(markdown):
    defined = defined_metrics()
    named = {re.sub(r"_(bucket|count|sum)$", "", m) for m in METRIC.findall(markdown.read_text())}
    unknown = sorted(named - defined - {"voxtriton_client"})
    assert not unknown, f"{markdown.relative_to(ROOT)}: no such metric: {', '.join(unknown)}"


def test_operations_lists_every_metric():
    listed = set(METRIC.findall((ROOT / "docs" / "operations.md").read_text()))
    assert not defined_metrics() - listed, sorted(defined_metrics() - listed)


def help_text(main, words: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*words, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("markdown", DOCS, **BY_PATH)
def test_command_line_flags_in_the_docs_exist(markdown):
    """`voxtriton SUB --flag`, `voxtriton-client speak --flag`, `--preset NAME` and
    `benchmarks/SCRIPT.py --flag` name options their parsers have."""
    mains = {"voxtriton": cli.main, "voxtriton-client": client_cli.main}
    helps: dict[tuple[str, str], str] = {}
    wrong = []
    for line in command_lines(markdown):
        for match in COMMAND.finditer(line):
            program, words = match.group(1), match.group(2).split()
            if (program, words[0]) not in COMMANDS:
                continue
            rest = re.split(SHELL_END + r"| [a-z_/]+\.py", line[match.end() :])[0]
            key = (program, " ".join(words))
            if key not in helps:
                helps[key] = help_text(mains[program], words)
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                if not re.search(rf"(?<![\w-]){flag}\b", helps[key]):
                    wrong.append(f"{key[0]} {key[1]} {flag}")
            for presets in re.findall(r"--preset ([a-z0-9.|-]+)", rest):
                choices = re.search(r"--preset \{([^}]*)\}", helps[key]).group(1).split(",")
                wrong += [f"--preset {p}" for p in presets.split("|") if p and p not in choices]
        for match in re.finditer(r"\b([a-z_]+)\.py\b", line):
            script = ROOT / "benchmarks" / f"{match.group(1)}.py"
            if not script.exists():
                continue
            rest = re.split(SHELL_END + r"| [a-z_/]+\.py", line[match.end() :])[0]
            source = script.read_text()
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                if f'"{flag}"' not in source:
                    wrong.append(f"{script.name} {flag}")
    assert not wrong, f"{markdown.relative_to(ROOT)}: no such option: {', '.join(sorted(set(wrong)))}"
