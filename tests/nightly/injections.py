"""Regressions the nightly must catch, injected into its engine processes
(``python -m tools.nightly --setup tests.nightly.injections:<name>``)."""

import copy
import time


def slow_drafter() -> None:
    """Each draft step takes 200 ms longer (host time outside the
    forwards): MTP's speedup collapses."""
    from vllm.v1.spec_decode.eagle import EagleProposer
    propose = EagleProposer.propose

    def slow(self, *args, **kwargs):
        time.sleep(0.2)
        return propose(self, *args, **kwargs)

    EagleProposer.propose = slow


def one_token() -> None:
    """The last token of the first request of every multi-token generate
    changes: one token per output set."""
    from vllm import LLM
    generate = LLM.generate

    def changed(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        completion = outputs[0].outputs[0]
        ids = list(completion.token_ids)
        if len(ids) > 1:
            vocab_size = self.llm_engine.model_config.get_vocab_size()
            ids[-1] = (ids[-1] + 1) % vocab_size
            completion.token_ids = ids
        return outputs

    LLM.generate = changed


def own_head() -> None:
    """The MTP draft computes its logits with a copy of the target's LM
    head instead of the head itself."""
    from vllm_ascend.spec_decode.mtp_proposer import AscendMtpProposer
    load_model = AscendMtpProposer.load_model

    def load_with_own_head(self, target_model):
        load_model(self, target_model)
        head = copy.deepcopy(target_model.lm_head)
        for layer in self.model.model.layers.values():
            layer.shared_head.head = head

    AscendMtpProposer.load_model = load_with_own_head


def _noisy_eh_proj(spread: float) -> None:
    import torch

    from vllm_ascend.spec_decode.mtp_proposer import AscendMtpProposer
    load_model = AscendMtpProposer.load_model

    def load_damaged(self, target_model):
        load_model(self, target_model)
        # Under graphs the draft is wrapped; its module is the runnable.
        model = getattr(self.model, "runnable", self.model)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".eh_proj." in name:
                    noise = torch.randn(param.shape, generator=generator)
                    param.add_(spread * param.float().std() *
                               noise.to(param.device, param.dtype))

    AscendMtpProposer.load_model = load_damaged


def damaged_mtp_layer() -> None:
    """The MTP layer's input projection (``eh_proj``, the layer's own
    weights: not shared with the target) gets seeded noise of twice its
    spread, as a corrupted checkpoint shard would: the draft guesses worse,
    the greedy outputs stay the target's."""
    _noisy_eh_proj(2.0)


def collapsed_mtp_layer() -> None:
    """The same with noise of 50 times the spread: the draft's guesses are
    noise and its acceptance near 0 (what the speculation watchdog must
    stop paying for)."""
    _noisy_eh_proj(50.0)


def all_kinds() -> None:
    """Every kind at once (one engine run in CI instead of three); each
    shows in its own figures."""
    slow_drafter()
    one_token()
    own_head()
