"""docker-compose.yml, checked without Docker: it parses, every command exists in the project and
accepts its flags, ports are on 127.0.0.1, and its settings are the ones the app reads."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.example.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
APP_SERVICES = ("payments", "worker", "flower", "demo")
EXTRA_ENV = {"FLOWER_UNAUTHENTICATED_API"}  # read by Flower, not by the app
REQUIRED_ENV = {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "EXAMPLE_PAYMENTS_URL", "EXAMPLE_QUEUE"}


@cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def services() -> dict[str, Any]:
    return dict(compose()["services"])


@cache
def app_env_names() -> set[str]:
    """The keys of ``ENV`` in example_app/celery_app.py (read from its source, not imported)."""
    tree = ast.parse((ROOT / "example_app" / "celery_app.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ENV":
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("example_app/celery_app.py defines no ENV")


def names_read_by_the_app() -> set[str]:
    """Every ``setting("X")`` / ``environ.get("X")`` / ``environ["X"]`` in example_app."""
    found = set()
    for path in (ROOT / "example_app").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                name = getattr(func, "id", None) or getattr(func, "attr", None)
                if name in ("setting", "get") and str(node.args[0].value).isupper():
                    found.add(str(node.args[0].value))
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and getattr(node.value, "id", "") in ("env", "environ") \
                    and str(node.slice.value).isupper():
                found.add(str(node.slice.value))
    return found


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command and healthcheck that runs in the project's image."""
    out = []
    for name, svc in services().items():
        if "build" not in svc:
            continue
        out.append((f"{name}.command", list(svc["command"])))
        test = svc.get("healthcheck", {}).get("test")
        if test:
            if test[0] == "CMD-SHELL":
                out.append((f"{name}.healthcheck", shlex.split(test[1].replace("$$", "$"))))
            else:
                assert test[0] == "CMD", f"{name}: healthcheck must be CMD or CMD-SHELL"
                out.append((f"{name}.healthcheck", list(test[1:])))
    return out


def test_it_parses_and_has_every_service_of_the_issue() -> None:
    assert set(services()) == {"redis", "postgres", "payments", "worker", "flower", "demo"}


def test_every_long_running_service_has_a_healthcheck_and_dependencies_wait_for_health() -> None:
    svcs = services()
    for name, svc in svcs.items():
        if name != "demo":
            assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in svcs, f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: {cond}"
            assert "healthcheck" in svcs[dep]


def test_every_port_is_bound_to_loopback() -> None:
    ports = [(n, p) for n, s in services().items() for p in s.get("ports", [])]
    assert {n for n, _ in ports} == {"redis", "postgres", "payments", "flower"}
    for name, port in ports:
        assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: {port}"
    assert "127.0.0.1:5555:5555" in services()["flower"]["ports"]


def test_the_image_is_built_from_a_dockerfile_in_the_project_with_what_the_services_need() -> None:
    for name in APP_SERVICES:
        build = services()[name]["build"]
        assert build["context"] == "."
        dockerfile = ROOT / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
        text = dockerfile.read_text()
        for line in text.splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}: no such path"
        assert "psycopg" in text and "redis" in text and "flower" in text


@pytest.mark.parametrize("where,argv", commands(), ids=[w for w, _ in commands()])
def test_every_command_exists_in_the_project_and_accepts_its_arguments(
    where: str, argv: list[str]
) -> None:
    if argv[:2] == ["python", "-m"]:
        module, rest = argv[2], argv[3:]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{where}: no {module}"
        _check_python_module_args(where, module, rest)
    elif argv[0] == "python" and argv[1] == "-c":
        compile(argv[2], where, "exec")
    else:
        assert argv[:2] == ["celery", "-A"], f"{where}: unexpected command {argv}"
        module, sub, rest = argv[2], argv[3], argv[4:]
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"{where}: no {module}"
        assert "app" in {t.id for n in ast.walk(ast.parse(path.read_text()))
                         if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        _check_celery_args(where, module, sub, rest)


def _check_python_module_args(where: str, module: str, rest: list[str]) -> None:
    if module == "example_app.demo":
        from example_app.demo import build_parser

        parser = build_parser()
    elif module == "example_app.payments":
        from example_app.payments import health_parser, serve_parser

        parser = {"serve": serve_parser, "health": health_parser}[rest[0]]()
        rest = rest[1:]
    else:
        raise AssertionError(f"{where}: no argument check for {module}")
    try:
        parser.parse_args(rest)
    except SystemExit as exc:
        raise AssertionError(f"{where}: {module} rejects {rest}") from exc


@cache
def _celery_help(module: str, sub: tuple[str, ...]) -> str:
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", module, *sub, "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _check_celery_args(where: str, module: str, sub: str, rest: list[str]) -> None:
    flags = [a.split("=", 1)[0] for a in rest if a.startswith("-")]
    if sub == "flower":
        import flower.options  # noqa: F401  (defines Flower's options)
        from tornado.options import options

        for flag in flags:
            assert flag.lstrip("-").replace("-", "_") in options, f"{where}: flower has no {flag}"
        return
    assert sub in ("worker", "inspect"), f"{where}: unexpected celery subcommand {sub}"
    words = (sub, rest[0]) if sub == "inspect" else (sub,)
    text = _celery_help(module, words)
    for flag in flags:
        assert f" {flag}," in text or f" {flag} " in text or f", {flag}" in text, \
            f"{where}: celery {' '.join(words)} has no {flag}"
    if sub == "worker":
        pool = rest[rest.index("-P") + 1]
        assert pool in text


def test_the_app_reads_exactly_the_names_in_its_env_table() -> None:
    read = names_read_by_the_app()
    env = app_env_names()
    assert env <= read, f"ENV lists names nothing reads: {env - read}"
    app_read = {n for n in read if n.startswith(("CELERY_", "EXAMPLE_"))}
    assert app_read <= env, f"names read but missing from ENV: {app_read - env}"


def test_every_app_service_gets_the_same_settings_and_only_names_the_app_reads() -> None:
    envs = {n: dict(services()[n]["environment"]) for n in APP_SERVICES}
    for name, env in envs.items():
        unknown = set(env) - app_env_names() - EXTRA_ENV
        assert not unknown, f"{name} sets {unknown}, which the app does not read"
        assert set(env) >= REQUIRED_ENV, f"{name} lacks {REQUIRED_ENV - set(env)}"
        shared = {k: v for k, v in env.items() if k not in EXTRA_ENV}
        assert shared == {k: v for k, v in envs["worker"].items() if k not in EXTRA_ENV}, name


def test_the_urls_point_at_the_services_with_their_credentials() -> None:
    svcs = services()
    env = svcs["worker"]["environment"]
    broker = urlsplit(env["CELERY_BROKER_URL"])
    assert broker.scheme == "redis" and broker.hostname == "redis" and broker.port == 6379
    pg = svcs["postgres"]["environment"]
    for url in (env["CELERY_RESULT_BACKEND"], env["CELERY_IDEM_STORE"]):
        parts = urlsplit(url)
        assert parts.scheme.startswith("db+postgresql")
        assert (parts.hostname, parts.port, parts.username, parts.password, parts.path) == \
               ("postgres", 5432, pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], f"/{pg['POSTGRES_DB']}")
    serve = svcs["payments"]["command"]
    db = urlsplit(serve[serve.index("--db") + 1])
    assert (db.hostname, db.username, db.path) == ("postgres", pg["POSTGRES_USER"], f"/{pg['POSTGRES_DB']}")
    payments = urlsplit(env["EXAMPLE_PAYMENTS_URL"])
    assert payments.hostname == "payments"
    assert str(payments.port) == serve[serve.index("--port") + 1]
    assert f"127.0.0.1:{payments.port}:{payments.port}" in svcs["payments"]["ports"]
    demo = svcs["demo"]["command"]
    assert demo[demo.index("--payments-url") + 1] == env["EXAMPLE_PAYMENTS_URL"]
    assert "--no-worker" in demo  # it uses the worker service, which consumes EXAMPLE_QUEUE


def test_the_demo_can_read_the_workers_event_log() -> None:
    svcs = services()
    log = Path(svcs["worker"]["environment"]["EXAMPLE_EVENT_LOG"])
    for name in ("worker", "demo"):
        mounts = [v.split(":")[1] for v in svcs[name].get("volumes", [])]
        assert str(log.parent) in mounts, f"{name} does not mount {log.parent}"


# -- what the docs say Flower needs ------------------------------------------------------------


def _operations_flowerconfig() -> str:
    """The flowerconfig.py docs/operations.md tells operators to write (its python block)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    for block in text.split("```python")[1:]:
        code = block.split("```", 1)[0]
        if "celery_idem.contrib.flower.install()" in code:
            return code
    raise AssertionError("docs/operations.md shows no flowerconfig.py")


def test_flower_loads_the_extension_the_way_the_docs_say() -> None:
    # docs/operations.md: Flower with --conf=<a file that calls celery_idem.contrib.flower.install()>,
    # and workers that send task events (-E)
    command = services()["flower"]["command"]
    assert command[:4] == ["celery", "-A", "example_app.celery_app", "flower"]
    confs = [arg.split("=", 1)[1] for arg in command if arg.startswith("--conf=")]
    assert len(confs) == 1, command
    conf = ROOT / confs[0]  # the image's WORKDIR is the repository root (COPY example_app)
    assert conf.is_file() and conf.parent == ROOT / "example_app", conf
    # The file does what the documented one does: the same statements, in the same order
    documented = [ast.dump(n) for n in ast.parse(_operations_flowerconfig()).body]
    ours = [ast.dump(n) for n in ast.parse(conf.read_text()).body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # docstring
    assert ours == documented, conf.read_text()
    assert "-E" in services()["worker"]["command"]
    assert services()["flower"]["environment"]["FLOWER_UNAUTHENTICATED_API"] == "true"


def test_the_servers_host_ports_do_not_clash_with_local_servers() -> None:
    for name, default in (("redis", 6379), ("postgres", 5432)):
        for port in services()[name]["ports"]:
            host_port = int(str(port).split(":")[1])
            assert host_port != default, f"{name} binds the host's default port {default}"


def test_the_readme_names_the_compose_file_and_its_ports() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up --build" in readme and "docker-compose.yml" in readme
    for port in ("16379", "15432", "5555"):
        assert port in readme, port
