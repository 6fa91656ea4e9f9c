/*
 * mooncake_dkv_plugin.h: the C interface of a distributed-KV store plugin for the
 * SSD tier of mooncake-rs (MOONCAKE_OFFLOAD_DKV_CLIENT=plugin,
 * MOONCAKE_OFFLOAD_DKV_PLUGIN=/path/libyourstore.so).
 *
 * A plugin is a shared library exporting every function below with C linkage. The
 * real client loads it at startup, checks mooncake_dkv_abi_version() and refuses to
 * start (naming the missing symbol or the version) when something does not match.
 *
 * Threading: the real client may call any function from several threads at once on
 * the same store handle; a plugin that cannot serve that must lock internally.
 *
 * Keys are byte strings (not NUL-terminated), at most 1 MiB. Values are byte strings
 * of at least one byte. Every length is in bytes.
 */
#ifndef MOONCAKE_DKV_PLUGIN_H
#define MOONCAKE_DKV_PLUGIN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this interface; a plugin returns it from mooncake_dkv_abi_version. */
#define MOONCAKE_DKV_ABI_VERSION 2

/* Per-key result codes. */
#define MOONCAKE_DKV_OK 0
#define MOONCAKE_DKV_NOT_FOUND 1        /* no such key */
#define MOONCAKE_DKV_TOO_SMALL 2        /* the destination is smaller than the value */
#define MOONCAKE_DKV_FULL 3             /* the store has no room */
#define MOONCAKE_DKV_ERROR 4            /* anything else (the store logs why) */

/* One key of a batch. For put: value/len are the value (tail is NULL). For get: the
 * destination is split in two: the value's first `len` bytes go to `value`, the rest to
 * `tail` (capacity `tail_len`; `value` may have len 0), so the caller's record header
 * and payload land where they belong without another copy. On return `len` is set to
 * the value's whole length (also when the result is MOONCAKE_DKV_TOO_SMALL, that is,
 * when the value is longer than len + tail_len). For exists and delete: value and tail
 * are NULL. */
typedef struct mooncake_dkv_item {
    const uint8_t *key;
    uint32_t key_len;
    uint8_t *value;
    uint64_t len;
    uint8_t *tail;
    uint64_t tail_len;
} mooncake_dkv_item;

/* One key found by a scan, with its value's length. `key` is owned by the plugin until
 * mooncake_dkv_free_entries. */
typedef struct mooncake_dkv_entry {
    uint8_t *key;
    uint32_t key_len;
    uint64_t value_len;
} mooncake_dkv_entry;

/* MOONCAKE_DKV_ABI_VERSION of the plugin. */
uint32_t mooncake_dkv_abi_version(void);

/* Opens the store described by `config` (MOONCAKE_OFFLOAD_DKV_URL, NUL-terminated, may
 * be empty). Returns a handle, or NULL when it cannot (the plugin logs why). */
void *mooncake_dkv_init(const char *config);

/* Closes a handle from mooncake_dkv_init. */
void mooncake_dkv_close(void *store);

/* Batches: `results[i]` gets the result code of `items[i]`. The return value is 0, or
 * -1 when the whole batch failed (then every result is MOONCAKE_DKV_ERROR). */
int32_t mooncake_dkv_batch_put(void *store, mooncake_dkv_item *items, uint32_t count,
                               int32_t *results);
int32_t mooncake_dkv_batch_get(void *store, mooncake_dkv_item *items, uint32_t count,
                               int32_t *results);
/* results[i]: MOONCAKE_DKV_OK when the key exists, MOONCAKE_DKV_NOT_FOUND when not. */
int32_t mooncake_dkv_batch_exists(void *store, mooncake_dkv_item *items, uint32_t count,
                                  int32_t *results);
/* Deleting a missing key is MOONCAKE_DKV_OK. */
int32_t mooncake_dkv_batch_delete(void *store, mooncake_dkv_item *items, uint32_t count,
                                  int32_t *results);

/* Lists up to `page` keys starting with `prefix`, from `cursor` (0 to start). Sets
 * `*entries` (an array the caller frees with mooncake_dkv_free_entries), `*count`, and
 * `*next_cursor` (0 when the listing is complete). Keys written or deleted during a
 * listing may or may not appear; no key present throughout is skipped. Returns 0, or
 * -1 on failure. */
int32_t mooncake_dkv_scan(void *store, const uint8_t *prefix, uint32_t prefix_len,
                          uint64_t cursor, uint32_t page, mooncake_dkv_entry **entries,
                          uint32_t *count, uint64_t *next_cursor);

/* Frees what mooncake_dkv_scan returned. */
void mooncake_dkv_free_entries(mooncake_dkv_entry *entries, uint32_t count);

/* Bytes the store can hold for this client, or -1 when it cannot tell. */
int64_t mooncake_dkv_capacity(void *store);

#ifdef __cplusplus
}
#endif

#endif /* MOONCAKE_DKV_PLUGIN_H */
