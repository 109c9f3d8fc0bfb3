/* BERT WordPiece tokenization, token for token what Hugging Face `tokenizers` gives for a
 * tokenizer.json of BertNormalizer (clean_text) + BertPreTokenizer + WordPiece, in one pass over the
 * bytes and without the offsets, strings and alignment bookkeeping `tokenizers` keeps for every
 * character (kernels/cpu_wordpiece.py decides which texts and tokenizers come here).
 *
 * Per text: control characters (0x00-0x1F but tab, newline, carriage return; 0x7F) are removed,
 * as clean_text does before anything splits; whitespace ends a word; each ASCII punctuation
 * character (33-47, 58-64, 91-96, 123-126) is a word of its own; letters are lowercased where the
 * normalizer lowercases. Text is UTF-8: of the characters past ASCII, U+00A0 and U+3000 are
 * whitespace and every other one is a word of its own. That is what the normalizer and the
 * pre-tokenizer make of a CJK ideograph and of punctuation, and the caller sends no other kind
 * (`FastWordPiece.takes`). Each word of at most `max_chars` characters is cut greedily into the
 * longest vocabulary pieces from its start, pieces after the first looked up with the continuation
 * prefix ("##"). A word with a position no piece matches, or a longer word, is the unknown token.
 * Around each text's ids: the template's prefix and suffix ids ([CLS] ... [SEP]).
 *
 * The vocabulary is an open-addressing hash table (FNV-1a) built once per tokenizer; lookups hash
 * the prefix and the piece without copying them. Built at first use by kernels/cpu_attention.py's
 * `load_library`; compared with `tokenizers` in tests/test_cpu_wordpiece.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t mask;              /* table size - 1 (a power of two) */
    int32_t *slot_id;           /* token id per slot, -1 for empty */
    int64_t *slot_off;          /* the key's offset in `keys` */
    int32_t *slot_len;          /* the key's length in bytes */
    char *keys;                 /* every key's bytes, back to back */
    char prefix[16];            /* continuation prefix ("##") */
    int32_t prefix_len;
    int32_t max_key_len;        /* longest key, in bytes */
} wp_vocab;

#define FNV_OFFSET 1469598103934665603ULL
#define FNV_PRIME 1099511628211ULL

static inline uint64_t fnv(uint64_t h, const char *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * FNV_PRIME;
    return h;
}

/* keys: `n` keys back to back, key i at offsets[i] .. offsets[i + 1]; ids: their token ids.
 * Returns NULL where memory runs out or the prefix is longer than 15 bytes. */
void *wp_vocab_new(const char *keys, const int64_t *offsets, const int32_t *ids, int64_t n,
                   const char *prefix, int32_t prefix_len) {
    if (prefix_len < 0 || prefix_len > 15) return NULL;
    wp_vocab *v = calloc(1, sizeof(wp_vocab));
    if (!v) return NULL;
    uint64_t size = 16;
    while (size < (uint64_t)n * 2 + 16) size <<= 1;
    v->mask = size - 1;
    v->slot_id = malloc(size * sizeof(int32_t));
    v->slot_off = malloc(size * sizeof(int64_t));
    v->slot_len = malloc(size * sizeof(int32_t));
    v->keys = malloc(offsets[n] > 0 ? (size_t)offsets[n] : 1);
    if (!v->slot_id || !v->slot_off || !v->slot_len || !v->keys) {
        free(v->slot_id); free(v->slot_off); free(v->slot_len); free(v->keys); free(v);
        return NULL;
    }
    memcpy(v->keys, keys, (size_t)offsets[n]);
    memcpy(v->prefix, prefix, (size_t)prefix_len);
    v->prefix_len = prefix_len;
    for (uint64_t s = 0; s <= v->mask; s++) v->slot_id[s] = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t off = offsets[i], len = offsets[i + 1] - offsets[i];
        if (len > v->max_key_len) v->max_key_len = (int32_t)len;
        uint64_t s = fnv(FNV_OFFSET, keys + off, len) & v->mask;
        while (v->slot_id[s] >= 0) {
            if (v->slot_len[s] == len && memcmp(v->keys + v->slot_off[s], keys + off, (size_t)len) == 0) break;
            s = (s + 1) & v->mask;          /* a repeated key keeps its first id */
        }
        if (v->slot_id[s] < 0) {
            v->slot_id[s] = ids[i];
            v->slot_off[s] = off;
            v->slot_len[s] = (int32_t)len;
        }
    }
    return v;
}

void wp_vocab_free(void *handle) {
    wp_vocab *v = handle;
    if (!v) return;
    free(v->slot_id); free(v->slot_off); free(v->slot_len); free(v->keys); free(v);
}

/* The id of (prefix if `cont`) + s[0:n], or -1. */
static inline int32_t lookup(const wp_vocab *v, int cont, const char *s, int64_t n) {
    int64_t p = cont ? v->prefix_len : 0;
    uint64_t h = fnv(cont ? fnv(FNV_OFFSET, v->prefix, p) : FNV_OFFSET, s, n);
    uint64_t slot = h & v->mask;
    while (v->slot_id[slot] >= 0) {
        if (v->slot_len[slot] == p + n) {
            const char *k = v->keys + v->slot_off[slot];
            if ((p == 0 || memcmp(k, v->prefix, (size_t)p) == 0) && memcmp(k + p, s, (size_t)n) == 0)
                return v->slot_id[slot];
        }
        slot = (slot + 1) & v->mask;
    }
    return -1;
}

/* One word's pieces appended at out[*k]; the unknown token where it cannot be cut. `n` bytes,
 * `chars` characters (a multi-byte character is only ever a word alone). */
static inline void word_pieces(const wp_vocab *v, const char *w, int64_t n, int64_t chars, int32_t max_chars,
                               int32_t unk, int32_t *out, int64_t *k) {
    if (chars > max_chars) { out[(*k)++] = unk; return; }
    int64_t start = 0, k0 = *k;
    while (start < n) {
        int64_t end = n, room = v->max_key_len - (start > 0 ? v->prefix_len : 0);
        if (end - start > room) end = start + room;
        int32_t id = -1;
        for (; end > start; end--) {
            id = lookup(v, start > 0, w + start, end - start);
            if (id >= 0) break;
        }
        if (id < 0) { *k = k0; out[(*k)++] = unk; return; }
        out[(*k)++] = id;
        start = end;
    }
}

static inline int is_punct(uint8_t c) {
    return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
}

/* `n` UTF-8 texts back to back (text i at offsets[i] .. offsets[i + 1]) to ids: text i's ids at
 * out[out_offsets[i] .. out_offsets[i + 1]]. `out` holds at least offsets[n] + n * (n_prefix +
 * n_suffix) ids (a text yields at most one piece per byte). Returns the ids written. `max_chars`
 * is at most 1023: a longer word is unknown whatever follows, so the scratch word stops there. */
int64_t wp_encode_batch(const void *handle, const char *text, const int64_t *offsets, int64_t n,
                        int32_t lowercase, int32_t max_chars, int32_t unk,
                        const int32_t *prefix_ids, int32_t n_prefix, const int32_t *suffix_ids, int32_t n_suffix,
                        int32_t *out, int64_t *out_offsets) {
    const wp_vocab *v = handle;
    char word[1024];
    int64_t k = 0;
    for (int64_t t = 0; t < n; t++) {
        out_offsets[t] = k;
        for (int32_t j = 0; j < n_prefix; j++) out[k++] = prefix_ids[j];
        int64_t len = 0;
        for (int64_t i = offsets[t]; i < offsets[t + 1]; i++) {
            uint8_t c = (uint8_t)text[i];
            if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
                if (len) { word_pieces(v, word, len, len, max_chars, unk, out, &k); len = 0; }
            } else if (c < 0x20 || c == 0x7f) {
                continue;                                   /* removed: the word goes on */
            } else if (is_punct(c)) {
                if (len) { word_pieces(v, word, len, len, max_chars, unk, out, &k); len = 0; }
                word[0] = (char)c;
                word_pieces(v, word, 1, 1, max_chars, unk, out, &k);
            } else if (c >= 0x80) {                         /* a character past ASCII: 2-4 bytes */
                int64_t nb = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
                if (nb > offsets[t + 1] - i) nb = offsets[t + 1] - i;     /* a cut sequence: what is left */
                if (len) { word_pieces(v, word, len, len, max_chars, unk, out, &k); len = 0; }
                /* U+00A0 (c2 a0) and U+3000 (e3 80 80) are spaces; any other is a word alone */
                const int space = (nb == 2 && c == 0xc2 && (uint8_t)text[i + 1] == 0xa0)
                               || (nb == 3 && c == 0xe3 && (uint8_t)text[i + 1] == 0x80 && (uint8_t)text[i + 2] == 0x80);
                if (!space) word_pieces(v, text + i, nb, 1, max_chars, unk, out, &k);
                i += nb - 1;
            } else {
                if (len == (int64_t)sizeof(word)) {
                    /* past the scratch space: longer than any max_chars (capped at 1023 by the
                     * caller), so the word is unknown however it continues */
                    len = (int64_t)sizeof(word) - 1;
                }
                word[len++] = (char)(lowercase && c >= 'A' && c <= 'Z' ? c + 32 : c);
            }
        }
        if (len) word_pieces(v, word, len, len, max_chars, unk, out, &k);
        for (int32_t j = 0; j < n_suffix; j++) out[k++] = suffix_ids[j];
    }
    out_offsets[n] = k;
    return k;
}
