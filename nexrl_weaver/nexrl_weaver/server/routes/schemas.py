"""The OpenAPI schemas of the bodies Weaver's routes read by hand
(`nexrl_weaver.server.bodies`), down to every number a client sends, so that a fuzzer
built on the app's schema reaches each one's check; the handlers check every field
and name what is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.http.openapi import OBJECT
from nexrl_core.http.openapi import json_body as described_body
from nexrl_service.runtime import SQL_INT_MAX
from nexrl_weaver.server.tensors import DTYPES

__all__ = [
    "ADAM_PARAMS", "FORWARD_INPUT", "INTEGERS", "MODEL_BODY", "SAMPLER_BODY", "SAMPLE_BODY", "SEQ_ID", "SESSION_BODY", "STRING",
    "described_body", "model_input", "payload_body",
]  # fmt: skip

STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
INTEGERS = {"type": "array", "items": INTEGER}
SEQ_ID = {"type": "integer", "minimum": 0, "maximum": SQL_INT_MAX}
TENSOR = {
    "anyOf": [
        {"type": "array", "items": NUMBER},
        {
            "type": "object",
            "properties": {
                "data": {"type": "array", "items": NUMBER},
                "dtype": {"type": "string", "enum": sorted(DTYPES)},
                "shape": INTEGERS,
            },
            "required": ["data"],
        },
    ]
}
"""A tensor as JSON (`nexrl_weaver.server.tensors.to_array`); ``$tensor`` slices come only in a multipart body."""


def model_input(tokens: Mapping[str, Any]) -> dict[str, Any]:
    """``{"chunks": [{"type": "encoded_text", "tokens": ...}]}`` with ``tokens`` as given."""
    chunk = {
        "type": "object",
        "properties": {"type": {"type": "string", "enum": ["encoded_text"]}, "tokens": tokens},
        "required": ["tokens"],
    }
    return {"type": "object", "properties": {"chunks": {"type": "array", "items": chunk}}, "required": ["chunks"]}


def payload_body(properties: Mapping[str, Any]) -> dict[str, Any]:
    """``{"payload": {...}}``, the body of a training operation, with the payload's fields."""
    payload = {"type": "object", "properties": {"model_id": STRING, "seq_id": SEQ_ID, **properties}}
    return described_body({"payload": payload}, required=("payload",))


FORWARD_INPUT = {
    "type": "object",
    "properties": {
        "loss_fn": STRING,
        "loss_fn_config": {"type": "object", "additionalProperties": {"type": ["number", "string"]}},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"model_input": model_input(TENSOR), "loss_fn_inputs": {"type": "object", "additionalProperties": TENSOR}},
                "required": ["model_input", "loss_fn_inputs"],
            },
        },
    },
    "required": ["loss_fn", "data"],
}
ADAM_PARAMS = {"type": "object", "properties": {field.name: NUMBER for field in attrs.fields(AdamWSettings)}}
LORA_CONFIG = {
    "type": "object",
    "properties": {"rank": INTEGER, "seed": INTEGER, "train_mlp": BOOLEAN, "train_attn": BOOLEAN, "train_unembed": BOOLEAN},
}
SAMPLING_PARAMS = {
    "type": "object",
    "properties": {
        "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "top_k": INTEGER, "seed": INTEGER, "sampling_seed": INTEGER,
        "stop": {"type": "array", "items": STRING}, "stop_token_ids": INTEGERS,
    },
}  # fmt: skip
SESSION_BODY = {"user_metadata": OBJECT, "tags": {"type": "array", "items": STRING}}
MODEL_BODY = {"base_model": STRING, "model_seq_id": SEQ_ID, "training_mode": STRING, "lora_config": LORA_CONFIG, "user_metadata": OBJECT}
SAMPLER_BODY = {"base_model": STRING, "model_id": STRING, "checkpoint_id": STRING, "sampling_session_seq_id": SEQ_ID}
SAMPLE_BODY = {
    "prompt": model_input(INTEGERS), "num_samples": {"type": "integer", "minimum": 1}, "sampling_params": SAMPLING_PARAMS,
    "prompt_logprobs": BOOLEAN, "topk_prompt_logprobs": INTEGER,
}  # fmt: skip
