"""torchtitan's test assets, made locally (its wheel ships none): a byte-level BPE tokenizer of
~500 tokens and a c4_test-shaped dataset of random-word text, under ``tests/assets`` of the
current directory (where torchtitan's ``c4_test`` dataset and ``--hf-assets-path`` look)."""
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

os.makedirs("tests/assets/c4_test", exist_ok=True)
os.makedirs("tests/assets/tokenizer", exist_ok=True)
rng = random.Random(0)
words = ("the of and to in is was for on that with as by at from his her it an were which are this be "
         "also has had first one their its new after who they have two been other all when there more "
         "time year city people world states united during between under known film later part over "
         "because while before where only through against since however such both each would some").split()
texts = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 600))) + "." for _ in range(2000)]
with open("tests/assets/c4_test/data.json", "w") as f:
    for t in texts:
        f.write(json.dumps({"text": t}) + "\n")
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tr = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts[:200], tr)
tok.save("tests/assets/tokenizer/tokenizer.json")
json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True},
          open("tests/assets/tokenizer/tokenizer_config.json", "w"))
print(tok.get_vocab_size())
