// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * rprof's in-kernel half. On every event of a target thread (a cpu-clock tick
 * or a syscall tracepoint) it finds *that* thread's Ruby execution context
 * through its own thread pointer, copies the VM's control frames in a few bulk
 * reads, reduces each frame to its identity (iseq, pc, method entry) and counts
 * the stack in a hash map. Names, paths and lines are resolved in userspace.
 * Nothing version-specific is compiled in: offsets come from `procs`.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "rprof.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define EEXIST	  17
#define CFP_BYTES (RPROF_CFP_CHUNK * RPROF_MAX_CFP_SIZE)
/*
 * `len` clamped to `max` (a power of two), in a form the verifier can bound:
 * the barrier stops clang from dropping the mask it deems redundant.
 */
#define CLAMPED(len, max)                                                                          \
	({                                                                                         \
		__u64 __len = (len);                                                               \
		if (__len > (max))                                                                 \
			__len = (max);                                                             \
		asm volatile("" : "+r"(__len));                                                    \
		__len &(2 * (max)-1);                                                              \
	})

/* A record's body: Ruby frames, then native frames, then kernel addresses. */
#define RUBY_BYTES   (RPROF_MAX_FRAMES * sizeof(struct rprof_frame))
#define NATIVE_BYTES (RPROF_MAX_NATIVE * sizeof(struct rprof_native_frame))
#define KERNEL_BYTES (RPROF_MAX_KERNEL * sizeof(__u64))

struct scratch {
	struct rprof_sample_header hdr;
	__u8 body[RUBY_BYTES + NATIVE_BYTES + KERNEL_BYTES]; /* must follow hdr directly */
	/* Twice the largest read, so a masked length always fits (see CLAMPED). */
	__u8 cfps[2 * CFP_BYTES];
	__u8 vstack[2 * RPROF_VSTACK_WINDOW];
	__u64 ruby_hash; /* of the Ruby frames, for the native program (tail call) */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct rprof_proc);
} procs SEC(".maps");

/* Processes whose forks are followed (--subprocesses). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct rprof_followed);
} followed SEC(".maps");

/* Native thread -> rb_thread_t, for RPROF_EC_THREAD_MAP processes. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct rprof_thread_key);
	__type(value, __u64);
} threads SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20); /* resized by userspace */
} samples SEC(".maps");

#define COUNTS_MAP                                                                                 \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_HASH);                                                   \
		__uint(max_entries, 65536);                                                        \
		__type(key, __u64);                                                                \
		__type(value, struct rprof_stack_count);                                           \
	}

COUNTS_MAP counts0 SEC(".maps");
COUNTS_MAP counts1 SEC(".maps");

/* counts[epoch & 1] is the live counts map; the other is being drained. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 2);
	__type(key, __u32);
	__array(values, COUNTS_MAP);
} counts SEC(".maps") = {
    .values = {&counts0, &counts1},
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RPROF_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

/* Two slots per CPU (sampling, tracing): a cpu-clock tick can interrupt a tracepoint program. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2); /* set to 2 * possible CPUs by userspace */
	__type(key, __u32);
	__type(value, struct scratch);
} scratch SEC(".maps");

/* Current counts epoch; userspace bumps it, then drains the other map. */
volatile __u64 epoch;

/* Set by userspace before loading: unwind native (--native) and kernel
 * (--kernel) stacks too. */
const volatile bool native_stacks = false;
const volatile bool kernel_stacks = false;

/* Keep the shared types in BTF so the skeleton generates them for Rust. */
struct rprof_frame rprof_frame_type;
struct rprof_sample_header rprof_sample_header_type;
enum rprof_ec_access rprof_ec_access_type;
enum rprof_sample_flags rprof_sample_flags_type;
enum rprof_stat rprof_stat_type;
enum rprof_record_kind rprof_record_kind_type;
enum rprof_process_change rprof_process_change_type;
struct rprof_process_event rprof_process_event_type;
enum rprof_frame_flags rprof_frame_flags_type;
struct rprof_unwind_rule rprof_unwind_rule_type;
struct rprof_unwind_row rprof_unwind_row_type;
struct rprof_unwind_file rprof_unwind_file_type;
struct rprof_space rprof_space_type;
struct rprof_native_frame rprof_native_frame_type;
struct rprof_thread_pointer rprof_thread_pointer_type;
enum rprof_cfa_kind rprof_cfa_kind_type;
enum rprof_rbp_kind rprof_rbp_kind_type;
enum rprof_file_flags rprof_file_flags_type;
enum rprof_mapping_kind rprof_mapping_kind_type;
enum rprof_native_stop rprof_native_stop_type;
enum rprof_unwind_page rprof_unwind_page_type;

struct walk_ctx {
	struct scratch *s;
	struct rprof_proc *p;
	__u64 cfp;
	__u64 win_lo;
	__u64 win_hi;
	__u64 hash;
	__u64 frame_flags; /* ep[0] of the frame walk_frame reads */
	__u32 n;
	__u32 out;
	__u32 failed;
};

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline __u64 rotl(__u64 v, int k)
{
	return (v << k) | (v >> (64 - k));
}

static __always_inline __u64 mix(__u64 h, __u64 v)
{
	h ^= v;
	h *= 0x9e3779b97f4a7c15ULL;
	return h ^ (h >> 31);
}

static __always_inline __u64 finish_hash(__u64 h)
{
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdULL;
	h ^= h >> 33;
	h *= 0xc4ceb9fe1a85ec53ULL;
	return h ^ (h >> 33);
}

static __always_inline __u64 cfp_field(struct scratch *s, __u32 base, __u32 off)
{
	__u64 at = (__u64)(base & (CFP_BYTES - 1)) + (off & (RPROF_MAX_CFP_SIZE - 8));

	if (at > CFP_BYTES + RPROF_MAX_CFP_SIZE - 8)
		return 0;
	asm volatile("" : "+r"(at));
	/* 8-aligned and inside cfps (2 * CFP_BYTES) for the verifier. */
	return *(__u64 *)(s->cfps + (at & (2 * CFP_BYTES - 8)));
}

/* ep[-2..0] (me_cref, specval, flags), from the copied value stack when it is there. */
/* Out of the copied window: a read of the target's memory. */
static __noinline int read_env_slow(__u64 lo, __u64 *env)
{
	return bpf_probe_read_user(env, 24, (void *)lo);
}

static __always_inline int read_env(struct walk_ctx *w, __u64 ep, __u64 env[3])
{
	__u64 lo = ep - 16;

	if (lo >= w->win_lo && ep + 8 <= w->win_hi) {
		__u64 off = lo - w->win_lo;
		const __u64 *src;

		if (off > RPROF_VSTACK_WINDOW - 24)
			return -1;
		src = (const __u64 *)(w->s->vstack + off);
		env[0] = src[0];
		env[1] = src[1];
		env[2] = src[2];
		return 0;
	}
	return read_env_slow(lo, env);
}

/* The method entry of a Ruby frame, found as Ruby's rb_vm_frame_method_entry
 * does; w->frame_flags gets the frame's own env flags (ep[0]). */
static __always_inline __u64 frame_method_entry(struct walk_ctx *w, __u64 ep)
{
	struct rprof_proc *p = w->p;
	__u64 env[3];

	for (int depth = 0; depth < RPROF_ENV_CHAIN_MAX; depth++) {
		if (read_env(w, ep, env))
			return 0;
		if (depth == 0)
			w->frame_flags = env[2];
		if (env[2] & p->env_flag_local)
			return env[0]; /* cme, a cref userspace will reject, or an svar (see
					  prepare_record) */
		if (env[0] && !(env[0] & 7)) {
			__u64 flags = 0;

			if (!bpf_probe_read_user(&flags, sizeof(flags), (void *)env[0]) &&
			    (flags & p->imemo_ment_mask) == p->imemo_ment_value)
				return env[0]; /* a block run as a method (define_method) */
		}
		ep = env[1] & ~3ULL;
		if (!ep)
			return 0;
	}
	return 0;
}

/* One control frame, at `base` in the copied chunk. Returns 1 to stop. */
static __always_inline int walk_frame(struct walk_ctx *w, __u32 base)
{
	struct scratch *s = w->s;
	struct rprof_proc *p = w->p;
	struct rprof_frame f = {};
	__u64 iseq, pc, ep;

	pc = cfp_field(s, base, p->cfp_pc);
	iseq = cfp_field(s, base, p->cfp_iseq);
	ep = cfp_field(s, base, p->cfp_ep);

	if (iseq) {
		/* pc 0: a C block (ifunc), or a frame YJIT pushed and has not
		 * written a pc to yet; userspace tells them apart. */
		f.iseq = iseq;
		f.pc = pc;
		w->frame_flags = 0;
		f.cme = frame_method_entry(w, ep);
		if (w->frame_flags & p->frame_flag_finish)
			f.flags = RPROF_FRAME_FINISH;
		if (p->cfp_jit_return && cfp_field(s, base, p->cfp_jit_return))
			f.flags |= RPROF_FRAME_JIT;
	} else {
		__u64 env[3];

		if (read_env(w, ep, env))
			return 0;
		if ((env[2] & p->frame_magic_mask) != p->frame_magic_cfunc)
			return 0; /* dummy frame at the base of a stack */
		f.cme = env[0];
	}
	if (w->out >= RPROF_MAX_FRAMES)
		return 1;
	((struct rprof_frame *)s->body)[w->out & (RPROF_MAX_FRAMES - 1)] = f;
	w->out++;
	w->hash = mix(mix(w->hash, f.iseq), (f.pc | f.flags) ^ rotl(f.cme, 32));
	return 0;
}

/* Control frame `i`; frames are copied from the target RPROF_CFP_CHUNK at a
 * time (the first chunk by the caller). bpf_loop calls this once per frame:
 * the verifier inlines the loop, and checks the body once. */
static long walk_one(__u32 i, struct walk_ctx *w)
{
	struct scratch *s = w->s;
	struct rprof_proc *p = w->p;
	__u32 slot = i % RPROF_CFP_CHUNK;

	if (i >= w->n)
		return 1;
	if (slot == 0 && i != 0) {
		__u32 left = w->n - i;

		if (left > RPROF_CFP_CHUNK)
			left = RPROF_CFP_CHUNK;
		if (bpf_probe_read_user(s->cfps, CLAMPED(left * p->cfp_size, CFP_BYTES),
					(void *)(w->cfp + (__u64)i * p->cfp_size))) {
			w->failed = 1;
			return 1;
		}
	}
	return walk_frame(w, slot * p->cfp_size);
}

static __always_inline int read_ec(struct rprof_proc *p, __u32 pid, __u64 tp, __u64 *ec)
{
	__u64 addr;

	switch (p->ec_access) {
	case RPROF_EC_GLOBAL:
		addr = p->ec_addr;
		break;
	case RPROF_EC_TLS_TPOFF:
		addr = tp + p->ec_addr;
		break;
	case RPROF_EC_TLS_DTV: {
		struct {
			__u64 val;
			__u64 to_free;
		} entry = {};
		__u64 dtv = 0;

		if (p->tls_tp_offset) { /* learned below: one read instead of three */
			addr = tp + p->tls_tp_offset;
			break;
		}
		if (bpf_probe_read_user(&dtv, sizeof(dtv), (void *)(tp + 8)) || !dtv)
			return -1;
		if (bpf_probe_read_user(&entry, sizeof(entry),
					(void *)(dtv + p->tls_module * p->dtv_entry_size)))
			return -1;
		if (!entry.val ||
		    entry.val == (__u64)-1) { /* TLS_DTV_UNALLOCATED: never touched here */
			*ec = 0;
			return 0;
		}
		addr = entry.val + p->ec_addr;
		/* glibc frees only dynamically allocated blocks: none to free means
		 * static TLS, at the same offset from every thread's pointer. */
		if (!entry.to_free && p->dtv_entry_size == 16)
			p->tls_tp_offset = (__s64)(addr - tp);
		break;
	}
	case RPROF_EC_THREAD_MAP: {
		struct rprof_thread_key key = {.pid = pid, .tp = tp};
		__u64 *th = bpf_map_lookup_elem(&threads, &key);

		if (!th) { /* not a Ruby thread, or one userspace has not seen yet */
			*ec = 0;
			return 0;
		}
		addr = *th + p->ec_addr;
		break;
	}
	default:
		return -1;
	}
	return bpf_probe_read_user(ec, sizeof(*ec), (void *)addr);
}

/* Does the EC's Ruby thread run on this native thread? (pthread_self() is the thread pointer.) */
static __always_inline int ec_is_this_thread(struct rprof_proc *p, __u64 th, __u64 tp)
{
	__u64 nt = th, id = 0;

	if (p->th_native_thread &&
	    bpf_probe_read_user(&nt, sizeof(nt), (void *)(th + p->th_native_thread)))
		return 0;
	if (bpf_probe_read_user(&id, sizeof(id), (void *)(nt + p->th_native_id)))
		return 0;
	return id == tp;
}

/* Under M:N threads (Ruby 3.3+) a native thread runs many Ruby threads: note
 * which one this is, so its samples are named after it. */
static __always_inline void read_ruby_thread(struct rprof_proc *p, struct scratch *s, __u64 th)
{
	__u8 dedicated = 0;

	if (!p->th_dedicated_mask || !th)
		return;
	if (bpf_probe_read_user(&dedicated, sizeof(dedicated),
				(void *)(th + p->th_dedicated_byte)) ||
	    (dedicated & p->th_dedicated_mask))
		return;
	s->hdr.ruby_thread = th;
}

static __always_inline void walk_stack(struct walk_ctx *w, __u64 ec, __u64 tp)
{
	struct rprof_proc *p = w->p;
	struct scratch *s = w->s;
	__u64 ecw[8] = {}, vm_stack, end, cfp, th, ep;
	__u32 size;

	if (bpf_probe_read_user(ecw, sizeof(ecw), (void *)ec)) {
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
		return;
	}
	vm_stack = ecw[(p->ec_vm_stack / 8) & 7];
	end = vm_stack + ecw[(p->ec_vm_stack_size / 8) & 7] * 8;
	cfp = ecw[(p->ec_cfp / 8) & 7];
	th = ecw[(p->ec_thread_ptr / 8) & 7];
	if (p->verify_thread) {
		if (!ec_is_this_thread(p, th, tp)) {
			s->hdr.flags |= RPROF_SAMPLE_FOREIGN_EC;
			return;
		}
		stat_inc(RPROF_STAT_VERIFIED);
	}
	read_ruby_thread(p, s, th);
	/* The base frame is a dummy (the main thread's names a "<main>" that
	 * never runs); Ruby's backtraces leave it out, and so do we. */
	end -= p->cfp_size;
	if (!p->cfp_size || cfp < vm_stack || cfp > end) {
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
		return;
	}
	if (cfp == end)
		return; /* an EC with no frames yet */
	w->cfp = cfp;
	w->n = (end - cfp) / p->cfp_size;
	if (w->n > RPROF_MAX_FRAMES) {
		w->n = RPROF_MAX_FRAMES;
		s->hdr.flags |= RPROF_SAMPLE_TRUNCATED;
	}

	size = (w->n < RPROF_CFP_CHUNK ? w->n : RPROF_CFP_CHUNK) * p->cfp_size;
	if (bpf_probe_read_user(s->cfps, CLAMPED(size, CFP_BYTES), (void *)cfp)) {
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
		return;
	}

	/* Every env lies below the leaf frame's: copy that much of the value stack at once. */
	ep = cfp_field(s, 0, p->cfp_ep);
	if (ep >= vm_stack && ep < end) {
		__u64 hi = ep + 8, lo = hi - RPROF_VSTACK_WINDOW;
		__u64 len;

		if (hi < RPROF_VSTACK_WINDOW || lo < vm_stack)
			lo = vm_stack;
		len = hi - lo;
		if (len <= RPROF_VSTACK_WINDOW &&
		    !bpf_probe_read_user(s->vstack, CLAMPED(len, RPROF_VSTACK_WINDOW),
					 (void *)lo)) {
			w->win_lo = lo;
			w->win_hi = hi;
		}
	}

	bpf_loop(RPROF_MAX_FRAMES, walk_one, w, 0);
	if (w->failed)
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
	if (s->hdr.flags & RPROF_SAMPLE_TRUNCATED)
		stat_inc(RPROF_STAT_TRUNCATED);
}

/* The GC's time, read after the frames: they hold still while this thread
 * runs BPF, so the time read now also describes them (src/gc_time.rs). The
 * flags are read before the count, as the GC writes the count first. */
static __always_inline int read_gc_time(struct rprof_proc *p, struct scratch *s, __u64 *time,
					__u32 *sample_flags)
{
	__u64 span = p->gc_count_addr - p->gc_flags_addr;
	__u32 flags = 0;
	__u64 count = 0;
	bool marking;

	/* Both words in one read when they are close (they are 0.4 to 1.4 KiB
	 * apart in Ruby 2.7 to 3.4): a read costs more than the bytes it copies. */
	if (p->gc_count_addr > p->gc_flags_addr && span <= CFP_BYTES - 8) {
		if (bpf_probe_read_user(s->cfps, CLAMPED(span + 8, CFP_BYTES),
					(void *)p->gc_flags_addr))
			return -1;
		flags = *(__u32 *)s->cfps;
		count = *(__u64 *)(s->cfps + (span & (CFP_BYTES - 1)));
	} else if (bpf_probe_read_user(&flags, sizeof(flags), (void *)p->gc_flags_addr) ||
		   bpf_probe_read_user(&count, sizeof(count), (void *)p->gc_count_addr)) {
		return -1;
	}
	marking = (flags & RPROF_GC_MODE_MASK) == RPROF_GC_MODE_MARKING;
	*time = count * 2 + (marking ? 0 : 1);
	/* Inside a GC but in no phase, the count does not tell which side of its
	 * marking this is: at its start (counted, not yet marking) or its end. */
	if ((flags & RPROF_GC_DURING_GC) && (flags & RPROF_GC_MODE_MASK) == RPROF_GC_MODE_NONE)
		*sample_flags |= RPROF_SAMPLE_GC_EDGE;
	/* Compaction moves objects past marking without a new count. */
	if ((flags & RPROF_GC_DURING_COMPACTING) && !marking)
		*sample_flags |= RPROF_SAMPLE_GC_MOVING;
	return 0;
}

/* Records do not wake userspace: its recording loop reads the buffer at
 * random moments (src/pace.rs). Woken by the record of a sample, rprof ran
 * right after each sampling tick, on another CPU just as that CPU's tick
 * came, and those ticks found rprof instead of the thread it displaced (a
 * Puma worker got from half to 1.17 of its share of samples). A wakeup also
 * costs the sampled process an interrupt. A filling buffer still wakes a
 * reader waiting on it (closing an epoch). */
static __always_inline __u64 wakeup_flags(void)
{
	return bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA) >
		       bpf_ringbuf_query(&samples, BPF_RB_RING_SIZE) / 8
		   ? BPF_RB_FORCE_WAKEUP
		   : BPF_RB_NO_WAKEUP;
}

static __always_inline long emit(struct scratch *s)
{
	__u64 size = sizeof(s->hdr) + (__u64)s->hdr.nframes * sizeof(struct rprof_frame) +
		     (__u64)s->hdr.nnative * sizeof(struct rprof_native_frame) +
		     (__u64)s->hdr.nkernel * sizeof(__u64);

	/* Only records carry the thread's name: most events are just counted. */
	bpf_get_current_comm(s->hdr.comm, sizeof(s->hdr.comm));
	if (size > sizeof(s->hdr) + sizeof(s->body))
		return -1;
	asm volatile("" : "+r"(size));
	if (size > sizeof(s->hdr) + sizeof(s->body))
		return -1;
	return bpf_ringbuf_output(&samples, s, size, wakeup_flags());
}

/* The first word (flags) of the object at `addr`, if it is one; else 0. */
static __always_inline __u64 object_flags(__u64 addr)
{
	__u64 flags = 0;

	if (!addr || (addr & 7) || bpf_probe_read_user(&flags, sizeof(flags), (void *)addr))
		return 0;
	return flags;
}

struct record_ctx {
	struct scratch *s;
	struct rprof_proc *p;
};

static long prepare_frame(__u32 i, struct record_ctx *r)
{
	struct rprof_frame *f = &((struct rprof_frame *)r->s->body)[i & (RPROF_MAX_FRAMES - 1)];
	struct rprof_proc *p = r->p;
	__u64 promoted = p->fl_promoted, flags;

	flags = object_flags(f->cme);
	if (f->iseq && flags && (flags & p->imemo_ment_mask) == p->imemo_svar_value) {
		__u64 at = f->cme + (p->svar_cref_or_me & 0xff), me = 0;

		bpf_probe_read_user(&me, sizeof(me), (void *)at);
		f->cme = me;
		flags = object_flags(me);
	}
	if (promoted && (flags & promoted) == promoted)
		f->flags |= RPROF_FRAME_CME_OLD;
	flags = object_flags(f->iseq);
	if (promoted && (flags & promoted) == promoted)
		f->flags |= RPROF_FRAME_ISEQ_OLD;
	if (flags && (flags & p->imemo_ment_mask) == p->imemo_ifunc_value)
		f->flags |= RPROF_FRAME_IFUNC;
	return 0;
}

/* Readies a record about to be sent, frame by frame (only records pay for
 * this, not every event):
 * - A method that has set $~ or $_ (a regexp match, gets) keeps them in an
 *   svar that takes its method entry's place in its env and holds the entry
 *   (Ruby's check_method_entry): the entry is sent, not the svar, a young
 *   object of each call that would be gone by the time it is read.
 * - A block written in C (an ifunc in the iseq slot) is flagged: it is no
 *   frame to name, and once freed it could not be told from one.
 * - Old (promoted) iseqs and method entries are flagged: userspace may name
 *   the record after minor GCs have run (a busy machine schedules it late),
 *   and an object old at the sample is the same object until a major GC. */
static __always_inline void prepare_record(struct scratch *s)
{
	__u32 tgid = s->hdr.pid;
	struct record_ctx r = {.s = s, .p = bpf_map_lookup_elem(&procs, &tgid)};

	if (!r.p)
		return;
	bpf_loop(s->hdr.nframes < RPROF_MAX_FRAMES ? s->hdr.nframes : RPROF_MAX_FRAMES,
		 prepare_frame, &r, 0);
}

static __always_inline void count_stack(struct scratch *s)
{
	struct rprof_stack_count *c = 0, init = {};
	__u32 live = epoch & 1;
	__u64 key = s->hdr.hash;
	void *map;
	long err;

	map = bpf_map_lookup_elem(&counts, &live);
	if (map) {
		c = bpf_map_lookup_elem(map, &key);
		if (!c) {
			err = bpf_map_update_elem(map, &key, &init, BPF_NOEXIST);
			if (!err || err == -EEXIST)
				c = bpf_map_lookup_elem(map, &key);
		}
	}
	if (!c) {
		/* The map is full: send this one event on its own. */
		stat_inc(RPROF_STAT_AGG_FULL);
		s->hdr.flags |= RPROF_SAMPLE_DIRECT;
		prepare_record(s);
		if (emit(s))
			stat_inc(RPROF_STAT_LOST);
		return;
	}
	__sync_fetch_and_add(&c->count, 1);
	/* If the ring buffer is full the count stays; a later event retries, and
	 * userspace reports counts whose stack never arrived as lost. */
	if (c->emitted)
		return;
	prepare_record(s);
	if (!emit(s))
		c->emitted = 1;
}

/* A process's start as /proc/PID/stat shows it (see RPROF_TICK_NS). */
static __always_inline __u64 start_ticks(struct task_struct *leader)
{
	return leader->start_boottime / RPROF_TICK_NS;
}

#include "native.bpf.h"

/* With --native and --kernel: the native and kernel stacks of this event,
 * after the Ruby frames in the record's body, mixed into its hash. */
static __always_inline __u64 other_stacks(void *ctx, struct rprof_proc *p, struct scratch *s,
					  __u64 hash)
{
	struct unwind_ctx u = {};
	__u32 nruby = s->hdr.nframes, nnative = 0, stat;
	__u64 off;
	long got;

	if (nruby > RPROF_MAX_FRAMES)
		nruby = RPROF_MAX_FRAMES;
	off = (__u64)nruby * sizeof(struct rprof_frame);
	asm volatile("" : "+r"(off));
	if (off > RUBY_BYTES)
		return hash;
	if (native_stacks) {
		nnative = unwind_native(&u, (struct rprof_native_frame *)(s->body + off),
					p->native_space);
		hash = mix(mix(hash, u.hash), u.stop);
		stat = RPROF_STAT_NATIVE_STOP + (u.stop < RPROF_NATIVE_STOP_MAX ? u.stop : 0);
		stat_inc(stat);
		s->hdr.nnative = nnative;
		s->hdr.native_stop = u.stop;
	}
	if (kernel_stacks) {
		__u64 koff = off + (__u64)nnative * sizeof(struct rprof_native_frame);

		asm volatile("" : "+r"(koff));
		if (koff > RUBY_BYTES + NATIVE_BYTES)
			return hash;
		got = bpf_get_stack(ctx, s->body + koff, KERNEL_BYTES, 0);
		if (got > 0) {
			__u32 n = got / sizeof(__u64);

			for (__u32 i = 0; i < RPROF_MAX_KERNEL && i < n; i++)
				hash = mix(hash, *((__u64 *)(s->body + koff) + i));
			s->hdr.nkernel = n;
		}
	}
	return hash;
}

/* The stack's identity, from the hash of its frames and its header; then counted. */
static __always_inline void finish(struct scratch *s, __u64 frames_hash)
{
	struct rprof_sample_header *h = &s->hdr;

	h->hash = finish_hash(
	    mix(mix(mix(mix(mix(mix(frames_hash, ((__u64)h->tid << 32) | h->event), h->flags),
			    h->nframes),
			h->gc_time),
		    h->ruby_thread),
		h->start_ticks));
	count_stack(s);
}

int on_cpu_sample_native(struct bpf_perf_event_data *ctx);
int on_tracepoint_native(void *ctx);

/* The programs on_event continues in with --native/--kernel: one array per
 * kind of program (an array serves programs of one type). */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, int(void *));
} tail_perf_event SEC(".maps") = {
    .values = {(void *)&on_cpu_sample_native},
};

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, int(void *));
} tail_tracepoint SEC(".maps") = {
    .values = {(void *)&on_tracepoint_native},
};

/* `tracepoint` is a constant at each call: a program may only use the
 * program array of its own type. */
static __always_inline int on_event(void *ctx, __u32 event, const bool tracepoint)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id, slot;
	struct rprof_proc *p;
	struct scratch *s;
	struct walk_ctx w = {};
	struct task_struct *task;
	__u64 tp, ec = 0;

	p = bpf_map_lookup_elem(&procs, &tgid);
	if (!p) {
		/* Followed, but not a Ruby rprof reads (yet: an exec'd program
		 * before its VM is up and inspected). */
		if (bpf_map_lookup_elem(&followed, &tgid))
			stat_inc(RPROF_STAT_NOT_PROFILED);
		return 0;
	}
	task = bpf_get_current_task_btf();
	/* A PID reused before userspace heard of the exit is another process. */
	if (start_ticks(task->group_leader) != p->start_ticks) {
		stat_inc(RPROF_STAT_OTHER_PROCESS);
		return 0;
	}
	stat_inc(RPROF_STAT_EVENTS);
	slot = bpf_get_smp_processor_id() * 2 + (event ? 1 : 0);
	s = bpf_map_lookup_elem(&scratch, &slot);
	if (!s)
		return 0;

	s->hdr.kind = RPROF_RECORD_SAMPLE;
	s->hdr.pid = tgid;
	s->hdr.start_ticks = p->start_ticks;
	s->hdr.tid = tid;
	s->hdr.event = event;
	s->hdr.flags = 0;
	s->hdr.nframes = 0;
	s->hdr.ruby_thread = 0;
	s->hdr.gc_time = 0;
	s->hdr.nnative = 0;
	s->hdr.native_stop = 0;
	s->hdr.nkernel = 0;
	tp = BPF_CORE_READ(task, thread.fsbase);

	w.s = s;
	w.p = p;
	if (read_ec(p, tgid, tp, &ec)) {
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
	} else if (!ec) {
		s->hdr.flags |= RPROF_SAMPLE_NO_EC;
		stat_inc(RPROF_STAT_NO_EC);
	} else {
		walk_stack(&w, ec, tp);
		if (w.out && read_gc_time(p, s, &s->hdr.gc_time, &s->hdr.flags))
			s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
	}
	if (s->hdr.flags & RPROF_SAMPLE_READ_FAILED) {
		stat_inc(RPROF_STAT_READ_FAILED);
		w.out = 0; /* a partial stack would lie */
		w.hash = 0;
	}
	if (s->hdr.flags & RPROF_SAMPLE_FOREIGN_EC)
		stat_inc(RPROF_STAT_FOREIGN_EC);

	s->hdr.nframes = w.out;
	if (native_stacks || kernel_stacks) {
		/* The native and kernel stacks in a program of their own, which
		 * the verifier checks apart from this one. */
		s->ruby_hash = w.hash;
		/* Said if the tail call cannot be made (it always can). */
		s->hdr.native_stop = native_stacks ? RPROF_NATIVE_NO_SPACE : 0;
		if (tracepoint)
			bpf_tail_call(ctx, &tail_tracepoint, 0);
		else
			bpf_tail_call(ctx, &tail_perf_event, 0);
	}
	finish(s, w.hash);
	return 0;
}

/* With --native/--kernel, after on_event: the stacks beyond Ruby's, for the
 * event whose Ruby frames are in scratch slot `slot`, then counting. */
static __always_inline int on_event_native(void *ctx, __u32 slot)
{
	struct scratch *s = bpf_map_lookup_elem(&scratch, &slot);
	struct rprof_proc *p;
	__u32 tgid;

	if (!s)
		return 0;
	tgid = s->hdr.pid;
	p = bpf_map_lookup_elem(&procs, &tgid);
	if (!p)
		return 0;
	finish(s, other_stacks(ctx, p, s, s->ruby_hash));
	return 0;
}

SEC("perf_event")
int on_cpu_sample_native(struct bpf_perf_event_data *ctx)
{
	return on_event_native(ctx, bpf_get_smp_processor_id() * 2);
}

SEC("tracepoint")
int on_tracepoint_native(void *ctx)
{
	return on_event_native(ctx, bpf_get_smp_processor_id() * 2 + 1);
}

SEC("perf_event")
int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
	return on_event(ctx, 0, false);
}

/* Attached to each traced tracepoint with its 1-based index as the BPF cookie. */
SEC("tracepoint")
int on_tracepoint(void *ctx)
{
	return on_event(ctx, (__u32)bpf_get_attach_cookie(ctx), true);
}

static __always_inline void process_event(__u32 change, __u32 pid, __u64 start, __u32 parent,
					  __u64 parent_start, __u64 gc_time, __u32 inherited)
{
	struct rprof_process_event e = {
	    .kind = RPROF_RECORD_PROCESS,
	    .change = change,
	    .pid = pid,
	    .parent = parent,
	    .start_ticks = start,
	    .parent_start_ticks = parent_start,
	    .gc_time = gc_time,
	    .inherited = inherited,
	};

	/* No wakeup (see wakeup_flags): it would cost the forking process an
	 * interrupt, most of this program's time in a VM. */
	if (bpf_ringbuf_output(&samples, &e, sizeof(e), wakeup_flags()))
		stat_inc(RPROF_STAT_PROCESS_LOST);
}

/* A followed process forked: the child is followed, and, until it execs,
 * shares its parent's memory layout, so it gets its parent's recipe now,
 * before it can run its first instruction. */
SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 ptgid = parent->tgid, ctgid = child->tgid;
	struct rprof_followed *f, cf;
	struct rprof_proc *p;
	__u64 pstart, gc_time = 0;

	if (ctgid == ptgid)
		return 0; /* a new thread */
	f = bpf_map_lookup_elem(&followed, &ptgid);
	pstart = start_ticks(parent->group_leader);
	if (!f || f->start_ticks != pstart)
		return 0;
	cf.start_ticks = start_ticks(child);
	bpf_map_update_elem(&followed, &ctgid, &cf, BPF_ANY);
	p = bpf_map_lookup_elem(&procs, &ptgid);
	if (p) {
		struct rprof_proc copy = *p;
		__u32 flags = 0;
		__u64 count = 0;

		copy.start_ticks = cf.start_ticks;
		bpf_map_update_elem(&procs, &ctgid, &copy, BPF_ANY);
		/* Ruby forks outside its GC: the count and phase say it all. */
		if (!bpf_probe_read_user(&flags, sizeof(flags), (void *)p->gc_flags_addr) &&
		    !bpf_probe_read_user(&count, sizeof(count), (void *)p->gc_count_addr))
			gc_time = count * 2 +
				  ((flags & RPROF_GC_MODE_MASK) == RPROF_GC_MODE_MARKING ? 0 : 1);
	}
	process_event(RPROF_PROCESS_FORK, ctgid, cf.start_ticks, ptgid, pstart, gc_time, !!p);
	return 0;
}

/* A followed process runs a new program: its recipe describes the old one. */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_exec, struct task_struct *task)
{
	__u32 tgid = task->tgid;
	struct rprof_followed *f = bpf_map_lookup_elem(&followed, &tgid);

	if (!f || f->start_ticks != start_ticks(task->group_leader))
		return 0;
	bpf_map_delete_elem(&procs, &tgid);
	process_event(RPROF_PROCESS_EXEC, tgid, f->start_ticks, 0, 0, 0, 0);
	return 0;
}

/* The last thread of a followed process ends (its `live` count is already
 * down when this tracepoint fires). */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit, struct task_struct *task)
{
	__u32 tgid = task->tgid;
	struct rprof_followed *f;
	__u64 start;

	if (task->signal->live.counter != 0)
		return 0;
	f = bpf_map_lookup_elem(&followed, &tgid);
	start = start_ticks(task->group_leader);
	if (!f || f->start_ticks != start)
		return 0;
	bpf_map_delete_elem(&followed, &tgid);
	bpf_map_delete_elem(&procs, &tgid);
	process_event(RPROF_PROCESS_EXIT, tgid, start, 0, 0, 0, 0);
	return 0;
}

/* The process whose threads `thread_pointers` lists (key 0). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} iter_tgid SEC(".maps");

/* Each thread's thread pointer, read from its task without stopping it: the
 * layout proof follows every thread's TLS to its EC, as the sampler will. */
SEC("iter/task")
int thread_pointers(struct bpf_iter__task *ctx)
{
	struct task_struct *task = ctx->task;
	struct rprof_thread_pointer out = {};
	__u32 zero = 0;
	__u32 *tgid = bpf_map_lookup_elem(&iter_tgid, &zero);

	if (!task || !tgid || task->tgid != *tgid)
		return 0;
	out.tid = task->pid;
	out.tp = BPF_CORE_READ(task, thread.fsbase);
	bpf_seq_write(ctx->meta->seq, &out, sizeof(out));
	return 0;
}
