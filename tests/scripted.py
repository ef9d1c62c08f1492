"""A scripted policy for multi-turn tests: it writes fixed text, whatever its weights."""

import torch

END = "<|im_end|>"


class ScriptedModel:
    """A 'policy' that writes fixed turns, turn j after the j-th tool output, one token per forward. Its
    KV cache holds the ids of the tokens it has read (keys = ids), so it sees its context only through
    the simulator's own cache handling (batching, padding, cutting after a tool call)."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, turns
        self.training = False
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": tokenizer.convert_tokens_to_ids(END)})

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, input_ids, attention_mask, past_key_values, **_):
        ids = input_ids.double()[:, None, :, None]
        keys, _ = past_key_values.update(ids, ids, 0)
        logits = torch.zeros(input_ids.shape[0], 1, len(self.tokenizer))
        for row in range(input_ids.shape[0]):
            context = keys[row, 0, :, 0].long()[attention_mask[row].bool()].tolist()
            response = self.tokenizer.decode(context, skip_special_tokens=False).split("<|im_start|>assistant\n")[-1]
            turn = response.count("</output>")
            written = response.rsplit("</output>", 1)[-1]
            rest = self.turns[turn][len(written) :] if turn < len(self.turns) else ""
            assert not rest or self.turns[turn].startswith(written)
            ids = self.tokenizer.encode(rest.removesuffix(END), add_special_tokens=False) or [0]
            logits[row, 0, self.tokenizer.convert_tokens_to_ids(END) if rest == END else ids[0]] = 100.0
        return type("Out", (), {"logits": logits})

    def load_state_dict(self, state):
        pass
