"""Reading the deployment files without a Docker daemon or a cluster: the Dockerfile's stages and
instructions, .dockerignore's rules, and a Python that cannot import torch (what the edge image is).

    stages = dockerfile_stages(REPO_ROOT / "Dockerfile")
    stages["cpu"].value("USER")        # the last USER of the stage or of the stages it is built FROM
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.services_helpers import REPO_ROOT

# Put first on PYTHONPATH, this makes `import torch` (and triton) fail in every process started with it.
NO_TORCH_SITECUSTOMIZE = '''
import sys

# As if they were not installed: `import torch` raises ModuleNotFoundError and importlib.util.find_spec
# (what transformers asks) answers None.
sys.modules["torch"] = None
sys.modules["triton"] = None
'''


def no_torch_pythonpath(directory: Path) -> str:
    """A PYTHONPATH entry under which torch and triton cannot be imported (the edge image's Python)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(NO_TORCH_SITECUSTOMIZE)
    return str(directory)


@dataclass
class Instruction:
    keyword: str
    args: str

    def words(self) -> list[str]:
        """The arguments in exec form (JSON) or as shell words."""
        text = self.args.strip()
        return json.loads(text) if text.startswith("[") else shlex.split(text)


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)
    parent: Stage | None = None  # the stage this one is built FROM, when it is one of ours

    def chain(self) -> list[Stage]:
        """This stage and the stages it builds on, base first."""
        return ([*self.parent.chain()] if self.parent else []) + [self]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for stage in self.chain() for i in stage.instructions if i.keyword == keyword]

    def value(self, keyword: str) -> Instruction | None:
        """The instruction in effect (the last one in the chain), or None."""
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for word in shlex.split(instruction.args):
                key, _, value = word.partition("=")
                values[key] = value
        return values

    def root_image(self) -> str:
        return self.chain()[0].base


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: a continuation line runs off the end"
    return instructions


def dockerfile_stages(path: Path) -> dict[str, Stage]:
    """Stages by name, in file order (dicts keep it); ARG defaults given before the first FROM are
    substituted into FROM lines."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: FROM {instruction.args}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], words[0])
            current = Stage(words[2], base, parent=stages.get(base))
            stages[current.name] = current
        elif current is None:
            assert instruction.keyword == "ARG", f"only ARG may come before the first FROM, not {instruction.keyword}"
            name, _, default = instruction.args.partition("=")
            global_args[name] = default
        else:
            current.instructions.append(instruction)
    return stages


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_includes(rules: list[str], path: str) -> bool:
    """Whether `path` (relative, '/'-separated) goes into the build context: docker's rule, the last
    matching pattern wins, and a pattern that matches a directory matches everything under it."""
    included = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        regex = _glob_regex(pattern.strip("/"))
        if any(regex.match(prefix) for prefix in prefixes):
            included = negate
    return included


def dockerignore_rules(path: Path = REPO_ROOT / ".dockerignore") -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
# The radixserve services of docker-compose.yml and their `radixserve` subcommand.
COMPOSE_SERVICES = {"tokenizer": "tokenizer", "worker": "worker", "detokenizer": "detokenizer", "gateway": "gateway"}
_VARIABLE = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, and $$ for a literal $; ValueError with the message of a required variable left unset."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        operator, argument = match.group(2), match.group(3) or ""
        value = env.get(name)
        missing = value is None or (operator is not None and operator.startswith(":") and value == "")
        if not missing:
            return value or ""
        if operator in ("?", ":?"):
            raise ValueError(f"required variable {name} is missing a value: {argument}")
        return argument if operator in ("-", ":-") else ""

    return _VARIABLE.sub(one, text)


def interpolate_values(node: Any, env: dict[str, str]) -> Any:
    """`node` (parsed YAML) with `interpolate` applied to every string value, as compose does it: after
    parsing, so a value's quotes, `#` or `: ` stay in the string and it stays a string (`12345`, `true`)."""
    if isinstance(node, dict):
        return {key: interpolate_values(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_values(value, env) for value in node]
    return interpolate(node, env) if isinstance(node, str) else node


def load_compose(env: dict[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """docker-compose.yml as compose reads it: YAML anchors and merge keys resolved, then variables
    substituted from `env` into the string values."""
    return interpolate_values(yaml.safe_load(path.read_text()), env)


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def flag_value(argv: list[str], flag: str) -> str:
    """The word after `flag` in `argv` (exactly one `flag` there)."""
    assert argv.count(flag) == 1, f"{flag} {argv.count(flag)} times in the command"
    return argv[argv.index(flag) + 1]
