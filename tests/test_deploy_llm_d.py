"""deploy/llm-d/ stays in step with `kvserve serve`: every flag the Deployment passes parses with the
CLI's own parser into a valid engine config, and the ports, block size and topic agree with the
endpoint picker's config."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvserve.cli import build_parser
from kvserve.config import EngineConfig
from kvserve.engine_args import engine_kwargs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "llm-d"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def kvserve_container() -> dict:
    (deployment,) = [d for d in docs("kvserve.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def scorer() -> dict:
    (config,) = docs("epp-config.yaml")
    (plugin,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    return plugin["parameters"]


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_the_deployments_flags_are_kvserve_serves_own():
    container = kvserve_container()
    assert container["command"] == ["kvserve"]
    args = build_parser().parse_args(container["args"])  # an unknown flag exits here
    assert args.command == "serve"
    EngineConfig(**engine_kwargs(args))  # and the values are valid
    ports = {p["containerPort"] for p in container["ports"]}
    events = scorer()["kvEventsConfig"]
    assert port_of(args.kv_events_endpoint) == events["podDiscoveryConfig"]["socketPort"]
    assert port_of(args.kv_events_replay_endpoint) == events["podDiscoveryConfig"]["replaySocketPort"]
    assert {args.port, port_of(args.kv_events_endpoint), port_of(args.kv_events_replay_endpoint)} <= ports
    assert args.page_size == scorer()["tokenProcessorConfig"]["blockSize"]
    assert args.kv_events_topic.startswith(events["topicFilter"])
    assert args.kv_events_topic.count("@") == 2 and "{model}" in args.kv_events_topic
    assert args.metrics_name_prefix == "vllm" and args.kv_events_encoding == "array"
    assert "POD_IP" in {e["name"] for e in container["env"]}


def test_the_picker_renders_on_the_served_model_name():
    args = build_parser().parse_args(kvserve_container()["args"])
    (config,) = docs("epp-config.yaml")
    (tokenizer,) = [p for p in config["plugins"] if p["type"] == "tokenizer"]
    assert tokenizer["parameters"]["modelName"] == args.served_model_name[0]
    refs = [p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]]
    assert {"tokenizer", "precise-prefix-cache-scorer", "max-score-picker"} <= set(refs)
