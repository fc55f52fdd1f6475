"""A local vision-language judge: the model's own text encoder (a Qwen-VL model that can answer) asked a pinned
yes/no question about each edit; its score is the probability of "yes" given the answer is yes or no,
p(yes) / (p(yes) + p(no)) of the first answer token, in [0, 1].

The questions are pinned (`QUESTIONS`: instruction following and preservation): the same question, chat template
and weights give the same scores, so `describe()` records the exact prompt text and the text encoder's fingerprint
(its files' hash) for eval.json. Each sample is judged alone (no padding beside other samples) and without
sampling: the scores are deterministic. On a tiny random model they are meaningless but still deterministic.

The VL model is built once per process for all the judge rewards of a run (`eval.rewards.judge_instruction`,
`judge_preservation` share it) through qie's component registry, as the caption stage builds it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from qie.errors import ConfigError
from qie.evaluation.reward import Reward

# The pinned questions: `{inputs}` names the control images ("Picture 1"), `{target}` the edit, `{instruction}`
# is the row's prompt. Without a control image the instruction question asks about the image alone (`ALONE`);
# preservation has nothing to compare with (nan).
QUESTIONS = {
    "instruction": (
        '{inputs} is the original image and {target} is the edited image. The edit instruction was: "{instruction}". '
        "Does {target} follow the instruction? Answer yes or no."
    ),
    "preservation": (
        '{inputs} is the original image and {target} is the edited image. The edit instruction was: "{instruction}". '
        "Apart from what the instruction asks for, is everything in {target} the same as in {inputs}? "
        "Answer yes or no."
    ),
}
ALONE = {"instruction": 'Does {target} show this: "{instruction}"? Answer yes or no.'}
ANSWERS = ("Yes", "No")

_LOADED: dict[str, tuple[Any, Any]] = {}  # the one VL model and processor built in this process, by what built it


class VlmJudge(Reward):
    """Scores each edit by the VL model's answer to one pinned question (`QUESTIONS`).

    Args:
        model: the run's `model` group (`ModelConfig`), given by the eval stage: its text encoder judges.
        question: "instruction" or "preservation".
        text_encoder_path: another folder of a text encoder of the model's family to judge with (default: the
            model's own).
        device: where the VL model runs ("auto": the GPU when there is one).
    """

    nan_when_unmeasured: ClassVar[bool] = True  # preservation with no control image to compare with

    def __init__(
        self, model: Any, question: str = "instruction", text_encoder_path: str | None = None, device: str = "auto"
    ) -> None:
        if question not in QUESTIONS:
            raise ConfigError(f"eval.rewards: VlmJudge question={question!r}: choose one of {', '.join(QUESTIONS)}")
        self.model = replace(model, text_encoder_path=text_encoder_path) if text_encoder_path else model
        self.question, self.device = question, device

    def _parts(self) -> tuple[Any, Any]:
        from qie.components import LoadSettings, load_parts, prepare_model
        from qie.models.captioning import caption_processor

        key = repr((self.model, self.device))
        if key not in _LOADED:
            _LOADED.clear()  # one judge model at a time
            spec = prepare_model(self.model)
            parts = load_parts(
                LoadSettings.of(self.model), spec, ["text_encoder", *spec.prompt_parts], {"text_encoder": self.device}
            )
            _LOADED[key] = (parts.text_encoder.eval(), caption_processor(parts, spec.family.part_classes["processor"]))
        return _LOADED[key]

    def _captioner(self, instruction: str | None, with_controls: bool) -> Any:
        from qie.models.captioning import Captioner, CaptionPrompt, GenerationSettings

        encoder, processor = self._parts()
        text = QUESTIONS[self.question] if with_controls else ALONE[self.question]
        if instruction is not None:
            text = text.replace("{instruction}", instruction)
        prompt = CaptionPrompt(f"judge_{self.question}", text, show_controls=with_controls)
        return Captioner(encoder, processor, prompt, GenerationSettings())

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        scores = []
        for image, ctrl, prompt in zip(images, controls, prompts):
            if not ctrl and self.question not in ALONE:
                scores.append(math.nan)
                continue
            captioner = self._captioner(prompt, bool(ctrl))
            shown = captioner.shown([_pil(c) for c in ctrl], _pil(image))
            batch = captioner.inputs([shown]).to(captioner.text_encoder.device)
            logits = captioner.text_encoder(**batch).logits[0, -1].float()
            yes, no = (_answer_token(captioner.processor.tokenizer, a) for a in ANSWERS)
            scores.append(float(torch.softmax(logits[[yes, no]], dim=0)[0]))
        return torch.tensor(scores, dtype=torch.float64)

    def describe(self) -> dict[str, Any]:
        """The question, its exact prompt text (chat template applied, one control image, `{instruction}` left as
        the placeholder), the answer scored and the text encoder's source and fingerprint."""
        from qie.components.fingerprint import part_fingerprint

        own = self.model.text_encoder_path
        source, subfolder = (str(own), "") if own else (str(self.model.pretrained_model_name_or_path), "text_encoder")
        return {
            "question": self.question,
            "prompt": self._captioner(None, True).text(1),
            "score": 'p("Yes") / (p("Yes") + p("No")) of the first answer token',
            "text_encoder": source if own else f"{source}/text_encoder",
            "fingerprint": part_fingerprint(source, subfolder, self.model.revision),
        }


def _answer_token(tokenizer: Any, answer: str) -> int:
    ids = tokenizer.encode(answer, add_special_tokens=False)
    if not ids:
        raise ConfigError(f"the judge's tokenizer has no token for {answer!r}")
    return int(ids[0])


def _pil(image: torch.Tensor) -> Image.Image:
    """A (3, H, W) tensor in [0, 1] as an 8-bit RGB image."""
    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(np.ascontiguousarray(array))


__all__ = ["ANSWERS", "QUESTIONS", "VlmJudge"]
