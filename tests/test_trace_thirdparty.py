"""Third-party models (Hugging Face Llama, timm ViT) trace, reproduce their loss and gradients
through the interpreter, are fully annotated, and split correctly op by op. Skipped cleanly when
transformers / timm are not installed."""

from __future__ import annotations

import pytest

from tests import test_trace_examples as ex

CASES = [pytest.param("hf_llama", marks=pytest.mark.skipif(
             not __import__("importlib").util.find_spec("transformers"),
             reason="transformers is not installed")),
         pytest.param("timm_vit", marks=pytest.mark.skipif(
             not __import__("importlib").util.find_spec("timm"),
             reason="timm is not installed"))]


@pytest.mark.parametrize("name", CASES)
def test_loss_and_gradients(name: str) -> None:
    ex.test_interpreter_matches_model_loss_and_gradients(name)


@pytest.mark.parametrize("name", CASES)
def test_annotated(name: str) -> None:
    ex.test_every_op_is_annotated(name)


@pytest.mark.parametrize("name", CASES)
def test_splits(name: str) -> None:
    ex.test_every_op_splits_on_real_activations(name)
