/*
 * A test plugin for docs/mooncake_dkv_plugin.h: an in-memory store, built by the
 * tests with the system C compiler. Entries live in an append-only array with
 * tombstones, so scan cursors (array positions) stay valid while keys come and go.
 * Config "capacity=N" sets the capacity it reports and enforces; "refuse" makes init
 * fail.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../../docs/mooncake_dkv_plugin.h"

typedef struct entry {
    uint8_t *key;
    uint32_t key_len;
    uint8_t *value;
    uint64_t len;
    int live;
} entry;

typedef struct store {
    pthread_mutex_t lock;
    entry *entries;
    uint64_t count;
    uint64_t allocated;
    uint64_t bytes;
    int64_t capacity;
} store;

uint32_t mooncake_dkv_abi_version(void) { return MOONCAKE_DKV_ABI_VERSION; }

void *mooncake_dkv_init(const char *config) {
    if (config && strcmp(config, "refuse") == 0) return NULL;
    store *s = calloc(1, sizeof(store));
    if (!s) return NULL;
    pthread_mutex_init(&s->lock, NULL);
    s->capacity = -1;
    if (config && strncmp(config, "capacity=", 9) == 0) s->capacity = atoll(config + 9);
    return s;
}

void mooncake_dkv_close(void *handle) {
    store *s = handle;
    for (uint64_t i = 0; i < s->count; i++) {
        free(s->entries[i].key);
        free(s->entries[i].value);
    }
    free(s->entries);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static entry *find(store *s, const uint8_t *key, uint32_t key_len) {
    for (uint64_t i = 0; i < s->count; i++) {
        entry *e = &s->entries[i];
        if (e->live && e->key_len == key_len && memcmp(e->key, key, key_len) == 0) return e;
    }
    return NULL;
}

static void drop(store *s, entry *e) {
    s->bytes -= e->len;
    e->live = 0;
    free(e->value);
    e->value = NULL;
}

static int32_t put_one(store *s, mooncake_dkv_item *item) {
    entry *old = find(s, item->key, item->key_len);
    uint64_t freed = old ? old->len : 0;
    if (s->capacity >= 0 && s->bytes - freed + item->len > (uint64_t)s->capacity)
        return MOONCAKE_DKV_FULL;
    if (s->count == s->allocated) {
        uint64_t grown = s->allocated ? s->allocated * 2 : 64;
        entry *more = realloc(s->entries, grown * sizeof(entry));
        if (!more) return MOONCAKE_DKV_ERROR;
        s->entries = more;
        s->allocated = grown;
        old = find(s, item->key, item->key_len);
    }
    entry e = {malloc(item->key_len), item->key_len, malloc(item->len), item->len, 1};
    if (!e.key || !e.value) {
        free(e.key);
        free(e.value);
        return MOONCAKE_DKV_ERROR;
    }
    if (old) drop(s, old);
    memcpy(e.key, item->key, item->key_len);
    memcpy(e.value, item->value, item->len);
    s->entries[s->count++] = e;
    s->bytes += e.len;
    return MOONCAKE_DKV_OK;
}

static int32_t get_one(store *s, mooncake_dkv_item *item) {
    entry *e = find(s, item->key, item->key_len);
    if (!e) return MOONCAKE_DKV_NOT_FOUND;
    uint64_t head = item->len;
    uint64_t capacity = head + (item->tail ? item->tail_len : 0);
    item->len = e->len;
    if (e->len > capacity) return MOONCAKE_DKV_TOO_SMALL;
    uint64_t first = e->len < head ? e->len : head;
    if (first) memcpy(item->value, e->value, first);
    if (e->len > first) memcpy(item->tail, e->value + first, e->len - first);
    return MOONCAKE_DKV_OK;
}

static int32_t exists_one(store *s, mooncake_dkv_item *item) {
    return find(s, item->key, item->key_len) ? MOONCAKE_DKV_OK : MOONCAKE_DKV_NOT_FOUND;
}

static int32_t delete_one(store *s, mooncake_dkv_item *item) {
    entry *e = find(s, item->key, item->key_len);
    if (e) drop(s, e);
    return MOONCAKE_DKV_OK;
}

static int32_t batch(void *handle, mooncake_dkv_item *items, uint32_t count, int32_t *results,
                     int32_t (*one)(store *, mooncake_dkv_item *)) {
    store *s = handle;
    pthread_mutex_lock(&s->lock);
    for (uint32_t i = 0; i < count; i++) results[i] = one(s, &items[i]);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int32_t mooncake_dkv_batch_put(void *h, mooncake_dkv_item *items, uint32_t n, int32_t *r) {
    return batch(h, items, n, r, put_one);
}
int32_t mooncake_dkv_batch_get(void *h, mooncake_dkv_item *items, uint32_t n, int32_t *r) {
    return batch(h, items, n, r, get_one);
}
int32_t mooncake_dkv_batch_exists(void *h, mooncake_dkv_item *items, uint32_t n, int32_t *r) {
    return batch(h, items, n, r, exists_one);
}
int32_t mooncake_dkv_batch_delete(void *h, mooncake_dkv_item *items, uint32_t n, int32_t *r) {
    return batch(h, items, n, r, delete_one);
}

int32_t mooncake_dkv_scan(void *handle, const uint8_t *prefix, uint32_t prefix_len,
                          uint64_t cursor, uint32_t page, mooncake_dkv_entry **entries,
                          uint32_t *count, uint64_t *next_cursor) {
    store *s = handle;
    pthread_mutex_lock(&s->lock);
    mooncake_dkv_entry *out = calloc(page ? page : 1, sizeof(mooncake_dkv_entry));
    uint32_t found = 0;
    uint64_t i = cursor;
    for (; i < s->count && found < page; i++) {
        entry *e = &s->entries[i];
        if (!e->live || e->key_len < prefix_len || memcmp(e->key, prefix, prefix_len) != 0)
            continue;
        out[found].key = malloc(e->key_len);
        memcpy(out[found].key, e->key, e->key_len);
        out[found].key_len = e->key_len;
        out[found].value_len = e->len;
        found++;
    }
    *entries = out;
    *count = found;
    *next_cursor = i < s->count ? i : 0;
    pthread_mutex_unlock(&s->lock);
    return 0;
}

void mooncake_dkv_free_entries(mooncake_dkv_entry *entries, uint32_t count) {
    for (uint32_t i = 0; i < count; i++) free(entries[i].key);
    free(entries);
}

int64_t mooncake_dkv_capacity(void *handle) { return ((store *)handle)->capacity; }
