"""``tgp``: the platform from a CI pipeline or a terminal.

Exit codes a pipeline can test: 0 done, 1 failed (the platform's message on stderr), 2 usage, 3 timed out
waiting. ``-o json`` on any command prints the platform's objects as JSON on stdout; messages and progress
go to stderr, so stdout stays parseable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from tgp.client import ApiError, Client, Config, Failed, TgpError, TimedOut

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3


# --- output --------------------------------------------------------------------------------------------


def _set_output(ctx: click.Context, _param, value: str | None) -> None:
    if value:
        ctx.find_root().meta["tgp.output"] = value


output_option = click.option(
    "-o",
    "--output",
    type=click.Choice(["text", "json"]),
    expose_value=False,
    is_eager=True,
    callback=_set_output,
    help="text (default) or json on stdout.",
)


def wants_json() -> bool:
    return click.get_current_context().find_root().meta.get("tgp.output") == "json"


def emit(data: Any, text: str | list[str] | None = None) -> None:
    """JSON of ``data`` in json mode, else ``text`` (or the JSON when there is no text form)."""
    if wants_json() or text is None:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(text if isinstance(text, str) else "\n".join(text))


def note(message: str) -> None:
    """A message for the person watching: stderr, so it never mixes into JSON output."""
    click.echo(message, err=True)


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def client() -> Client:
    ctx = click.get_current_context()
    config = Config.load()
    team = ctx.find_root().params.get("team") or config.team
    api = Client(config.url, config.token, team)
    # Close the kept-alive connection when the command ends (main() may run many commands in one process).
    ctx.find_root().call_on_close(api.close)
    return api


# --- the commands --------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--team", envvar="TGP_TEAM", help="Team slug (default: the token's team).")
@output_option
def cli(team: str | None) -> None:
    """Ship models to the Triton GE serving platform: upload, convert, deploy, roll out, call."""


@cli.command()
@click.option("--url", help="The platform's address, e.g. https://serving.example.com (or TGP_URL).")
@click.option("--token", help="An API token (tgp_...); read from TGP_TOKEN or asked for when omitted.")
@click.option("--team", "login_team", help="Team slug to act in when the account is in several.")
@output_option
def login(url: str | None, token: str | None, login_team: str | None) -> None:
    """Check a token against the platform and store it (mode 0600) in the config directory."""
    config = Config.load()
    config.url = url or config.url
    if not config.url:
        raise click.UsageError("Give the platform's address with --url (or TGP_URL).")
    if not token:
        if sys.stdin.isatty():
            token = click.prompt("API token", hide_input=True)
        else:  # a pipeline pipes it in: never on the command line, where `ps` shows it
            token = sys.stdin.readline().strip() or config.token
    if not token:
        raise click.UsageError("Give an API token (--token, TGP_TOKEN or on standard input).")
    config.token = token
    with Client(config.url, token, login_team or "") as api:
        me = api.me()
        config.team = api.team
    path = config.save()
    emit(
        {"url": config.url, "team": config.team, "username": me["username"], "config": str(path)},
        f"Signed in to {config.url} as {me['username']} (team {config.team}); saved to {path}.",
    )


@cli.group()
def models() -> None:
    """The team's models."""


@models.command("list")
@output_option
def models_list() -> None:
    """List the team's models with their latest version."""
    rows = client().list_models()
    emit(
        rows,
        table(
            [
                [m["slug"], m["name"], m["version_count"], (m["latest_version"] or {}).get("number"),
                 (m["latest_version"] or {}).get("state")]
                for m in rows
            ],
            ["SLUG", "NAME", "VERSIONS", "LATEST", "STATE"],
        ),
    )  # fmt: skip


@models.command("create")
@click.argument("name")
@click.option("--slug", default="", help="Derived from the name when omitted.")
@click.option("--task-type", default="", help="e.g. classification, detection, other.")
@click.option("--description", default="")
@output_option
def models_create(name: str, slug: str, task_type: str, description: str) -> None:
    """Create a model (the versions are uploaded into it)."""
    model = client().create_model(name, slug=slug, task_type=task_type, description=description)
    emit(model, f"Created model {model['slug']} ({model['name']}).")


def objective_text(model: dict) -> str:
    if model.get("objective_p99_ms") is None:
        return f"{model['slug']}: no latency objective."
    rate = model.get("objective_rate_rps")
    within = f"p99 <= {model['objective_p99_ms']:g} ms"
    return f"{model['slug']}: " + (
        f"{within} at {rate:g} requests/s." if rate is not None else f"the most throughput with {within}."
    )


@models.command("objective")
@click.argument("model")
@click.option("--p99-ms", type=float, help="The p99 bound in milliseconds.")
@click.option(
    "--rate", "rate_rps", type=float, help="Requests/s the bound holds at (default: the most throughput)."
)
@click.option("--clear", is_flag=True, help="Remove the objective.")
@output_option
def models_objective(model: str, p99_ms: float | None, rate_rps: float | None, clear: bool) -> None:
    """Set the model's latency objective, which tuning measures its versions' configs against."""
    if clear == (p99_ms is not None):
        raise click.UsageError("give either --p99-ms (and optionally --rate) or --clear")
    if clear and rate_rps is not None:
        raise click.UsageError("--rate goes with --p99-ms, not --clear")
    updated = client().set_objective(model, None if clear else p99_ms, rate_rps)
    emit(updated, objective_text(updated))


class Progress:
    """A progress bar on a terminal, plain lines (every 10 %) in a pipeline's log."""

    def __init__(self) -> None:
        self.bar = None
        self.reported = -1

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self.bar is None:
                self.bar = click.progressbar(length=total, label="Uploading", file=sys.stderr)
                self.bar.__enter__()
            self.bar.update(done - self.bar.pos)
            return
        tenth = done * 10 // max(total, 1)
        if tenth != self.reported:
            self.reported = tenth
            note(f"uploaded {done} of {total} bytes ({done * 100 // max(total, 1)}%)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "-m", required=True, help="The model's slug.")
@click.option("--wait", is_flag=True, help="Wait until the conversion made the version READY.")
@click.option("--timeout", type=click.FloatRange(min=0), default=1800, show_default=True, help="Seconds.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=8 * 1024 * 1024, hidden=True)
@output_option
def upload(file: Path, model: str, wait: bool, timeout: float, chunk_size: int) -> None:
    """Upload FILE as the model's next version (resumable: run it again after an interruption)."""
    api = client()
    progress = Progress()
    try:
        version = api.upload(
            file,
            model,
            chunk_size=chunk_size,
            progress=progress,
            on_resume=lambda offset: note(f"Resuming an earlier upload of {file.name} at byte {offset}."),
        )
    finally:
        progress.close()
    note(f"Uploaded {file.name} as version {version['number']} of {model} ({version['state']}).")
    if wait:
        version = api.wait_for_version(
            model,
            version["number"],
            timeout=timeout,
            on_state=lambda v: note(f"version {v['number']}: {v['state']}"),
        )
    emit(version, f"{model} v{version['number']} {version['state']}")


@cli.command()
@click.argument("model")
@output_option
def versions(model: str) -> None:
    """List a model's versions, newest first."""
    rows = client().list_versions(model)
    emit(
        rows,
        table(
            [[v["number"], v["state"], v["source_format"], v["source_filename"], v["size_bytes"],
              (v["sha256"] or "")[:12], v["created_at"]] for v in rows],
            ["VERSION", "STATE", "FORMAT", "FILE", "BYTES", "SHA256", "CREATED"],
        ),
    )  # fmt: skip


@cli.command()
@click.argument("model")
@click.option(
    "--version", "-v", "number", type=click.IntRange(min=1), required=True, help="The READY version."
)
@click.option(
    "--batching/--no-batching", default=None, help="Dynamic batching on or off (default: as the version)."
)
@click.option("--max-batch-size", type=click.IntRange(min=0))
@click.option("--max-queue-delay-us", type=click.IntRange(min=0))
@click.option("--preferred", help="Preferred batch sizes, comma-separated (empty string: none).")
@click.option("--instances", "instance_count", type=click.IntRange(min=1))
@click.option("--note", default="")
@output_option
def derive(
    model: str,
    number: int,
    batching: bool | None,
    max_batch_size: int | None,
    max_queue_delay_us: int | None,
    preferred: str | None,
    instance_count: int | None,
    note: str,
) -> None:
    """Create the next version of MODEL serving version N's files with other serving settings (READY at
    once; roll it out as any version). Settings not given stay the version's."""
    api = client()
    current = api.serving_settings(model, number)
    changes = {
        "dynamic_batching": batching,
        "max_batch_size": max_batch_size,
        "max_queue_delay_us": max_queue_delay_us,
        "instance_count": instance_count,
    }
    serving = {**current, **{k: v for k, v in changes.items() if v is not None}}
    if preferred is not None:
        try:
            serving["preferred"] = [int(p) for p in preferred.split(",") if p.strip()]
        except ValueError:
            raise click.BadParameter(
                "comma-separated whole numbers, e.g. 8,16", param_hint="--preferred"
            ) from None
    derived = api.derive_version(model, number, serving, note=note)
    emit(derived, f"{model} v{derived['version']} {derived['state']} (from v{number})")


def _tuning_text(job: dict) -> str:
    where = f" on {job['instance']}" if job.get("instance") else ""
    return (
        f"tuning {job['id']}: {job['model']} v{job['version']} {job['state']}{where}, "
        f"{job['points_measured']} point(s)" + (f" - {job['reason']}" if job.get("reason") else "")
    )


@cli.command()
@click.argument("model")
@click.option("--version", "-v", "number", type=click.IntRange(min=1), required=True, help="A READY version.")
@click.option("--pool", help="The pool to measure on (default: any the team may use).")
@click.option("--budget-s", type=click.IntRange(min=1), help="The time budget in seconds (30-3600; 300).")
@click.option("--max-candidates", type=click.IntRange(min=1), help="Configs to measure at most (1-30; 12).")
@click.option("--max-instances", type=click.IntRange(min=1), help="Most model instances per config (1).")
@click.option(
    "--wait", is_flag=True, help="Wait for the result (exit 1 when it fails, is cancelled or times out)."
)
@click.option("--create-version", "create", is_flag=True, help="With --wait: create the recommended version.")
@click.option("--timeout", type=click.FloatRange(min=0), default=3900, show_default=True, help="Seconds.")
@output_option
def tune(
    model: str,
    number: int,
    pool: str | None,
    budget_s: int | None,
    max_candidates: int | None,
    max_instances: int | None,
    wait: bool,
    create: bool,
    timeout: float,
) -> None:
    """Measure version N of MODEL on a pool against the model's latency objective (``tgp models
    objective``) and print the recommendation; --create-version makes it a version to roll out."""
    if create and not wait:
        raise click.UsageError("--create-version needs --wait.")
    api = client()
    job = api.start_tuning(
        model,
        number,
        pool=pool,
        budget_s=budget_s,
        max_candidates=max_candidates,
        max_instances=max_instances,
    )
    if not wait:
        emit(job, _tuning_text(job))
        return
    note(_tuning_text(job))
    job = api.wait_for_tuning(job["id"], timeout=timeout, on_progress=lambda j: note(_tuning_text(j)))
    lines = [_tuning_text(job), job["message"]]
    if create:
        if job.get("recommended") is None:
            raise Failed(f"Tuning {job['id']} recommends no config: {job['message']}")
        if job["recommended"] == (job.get("result") or {}).get("default"):
            job = {**job, "created_version": None}
            lines.append(f"v{number}'s own config is the best measured: no version created.")
        else:
            made = api.create_tuned_version(job["id"])
            job = {**job, "created_version": made["version"]}
            lines.append(f"{model} v{made['version']} READY with the recommended config; roll it out.")
    emit(job, lines)


@cli.command()
@click.option("--model", help="Only this model's tunings.")
@click.option("--cancel", "cancel_id", type=click.IntRange(min=1), help="Cancel this tuning job instead.")
@output_option
def tunings(model: str | None, cancel_id: int | None) -> None:
    """List the team's tuning jobs, newest first (or cancel one with --cancel ID)."""
    api = client()
    if cancel_id is not None:
        job = api.cancel_tuning(cancel_id)
        emit(job, _tuning_text(job))
        return
    rows = api.list_tunings(model)
    emit(
        rows,
        table(
            [[j["id"], j["model"], j["version"], j["state"], j["points_measured"], j["pool"] or "any",
              j.get("message") or j.get("reason")] for j in rows],
            ["ID", "MODEL", "VERSION", "STATE", "POINTS", "POOL", "RESULT"],
        ),
    )  # fmt: skip


def _deployment_text(d: dict) -> str:
    ready = sum(1 for p in d.get("placements", []) if p["state"] == "READY")
    return (
        f"{d['model']}: {d['state']} v{d['active_version']}"
        + (
            f" -> v{d['target_version']}"
            if d.get("target_version") not in (None, d["active_version"])
            else ""
        )
        + f", {ready}/{len(d.get('placements', []))} placements ready"
        + (f" ({d['last_error']})" if d.get("last_error") else "")
    )


@cli.command()
@click.argument("model")
@click.option("--version", "-v", "number", type=click.IntRange(min=1), required=True)
@click.option("--instance", "instances", type=int, multiple=True, help="Instance id to serve on (repeat).")
@click.option("--replicas", type=click.IntRange(min=1), help="How many replicas the platform places.")
@click.option(
    "--wait", is_flag=True, help="Wait until the deployment serves the version: a call then succeeds."
)
@click.option("--timeout", type=click.FloatRange(min=0), default=600, show_default=True, help="Seconds.")
@output_option
def deploy(
    model: str, number: int, instances: tuple[int, ...], replicas: int | None, wait: bool, timeout: float
) -> None:
    """Serve a READY version: deploy it, or switch the model's live deployment to it."""
    api = client()
    deployment = api.deploy(model, number, instances=list(instances), replicas=replicas)
    if wait:
        deployment = api.wait_for_deployment(model, version=number, timeout=timeout)
    emit(deployment, _deployment_text(deployment))


@cli.group()
def rollout() -> None:
    """Progressive rollouts of a new version with health gates."""


def _rollout_text(r: dict) -> str:
    return (
        f"rollout {r['id']}: v{r['stable_version']} -> v{r['canary_version']} {r['state']}, "
        f"canary at {r['current_weight']}%" + (f" ({r['reason']})" if r.get("reason") else "")
    )


def _watch(api: Client, model: str, timeout: float) -> dict:
    last = None
    for last in api.watch_rollout(model, timeout=timeout):
        if not wants_json():
            note(_rollout_text(last))
    return last


@rollout.command("start")
@click.argument("model")
@click.option("--version", "-v", "number", type=click.IntRange(min=1), required=True)
@click.option("--steps", help="Canary weights in percent, e.g. 10,25,50,100.")
@click.option("--step-interval", type=click.IntRange(min=1), help="Seconds per step.")
@click.option(
    "--watch",
    "--wait",
    "watch",
    is_flag=True,
    help="Follow it until promoted and the new version is callable (0), rolled back (1) or --timeout (3).",
)
@click.option("--timeout", type=click.FloatRange(min=0), default=3600, show_default=True)
@output_option
def rollout_start(
    model: str, number: int, steps: str | None, step_interval: int | None, watch: bool, timeout: float
) -> None:
    """Start rolling out a version to the model's live deployment."""
    try:
        weights = [int(s) for s in steps.split(",")] if steps else None
    except ValueError:
        raise click.BadParameter(
            "comma-separated integers, e.g. 10,25,50,100", param_hint="--steps"
        ) from None
    api = client()
    result = api.start_rollout(model, number, steps=weights, step_interval_s=step_interval)
    if watch:
        result = _watch(api, model, timeout)
    emit(result, _rollout_text(result))


@rollout.command("status")
@click.argument("model")
@click.option("--watch", "--wait", "watch", is_flag=True, help="Follow it until it finishes.")
@click.option("--timeout", type=click.FloatRange(min=0), default=3600, show_default=True)
@output_option
def rollout_status(model: str, watch: bool, timeout: float) -> None:
    """The model's latest rollout."""
    api = client()
    result = _watch(api, model, timeout) if watch else api.latest_rollout(model)
    emit(result, _rollout_text(result))


@rollout.command("promote")
@click.argument("model")
@output_option
def rollout_promote(model: str) -> None:
    """Promote the running rollout now: the canary serves everything."""
    result = client().rollout_action(model, "promote")
    emit(result, _rollout_text(result))


@rollout.command("abort")
@click.argument("model")
@output_option
def rollout_abort(model: str) -> None:
    """Abort the running rollout: traffic goes back to the stable version."""
    result = client().rollout_action(model, "abort")
    emit(result, _rollout_text(result))


@cli.command()
@output_option
def status() -> None:
    """The team's live deployments and their placements."""
    rows = [d for d in client().list_deployments() if d["state"] != "UNDEPLOYED"]
    emit(rows, [_deployment_text(d) for d in rows] or ["No live deployments."])


@cli.command()
@click.argument("model")
@click.option(
    "--json", "body_file", type=click.File("r"), required=True, help="KServe v2 request body ('-': stdin)."
)
@output_option
def infer(model: str, body_file) -> None:
    """Call the model through the inference gateway with a KServe v2 JSON body; prints the response."""
    try:
        body = json.load(body_file)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--json") from None
    result = client().infer(model, body)
    emit(result, json.dumps(result, indent=2))


# --- the entry point -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run ``tgp`` with ``argv`` and return its exit code (the console script exits with it)."""
    try:
        cli.main(args=argv, prog_name="tgp", standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help
        return exc.exit_code
    except click.UsageError as exc:
        exc.show()
        return EXIT_USAGE
    except click.Abort:
        note("Aborted.")
        return EXIT_FAILED
    except TimedOut as exc:
        note(f"Timed out: {exc}")
        return EXIT_TIMEOUT
    except ApiError as exc:
        note(f"Error ({exc.status}): {exc}")
        return EXIT_FAILED
    except (Failed, TgpError) as exc:
        note(f"Error: {exc}")
        return EXIT_FAILED
    return EXIT_OK
