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
#include <bpf/bpf_endian.h>
#include "rprof.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define EEXIST	  17
#define CFP_BYTES (RPROF_CFP_CHUNK * RPROF_MAX_CFP_SIZE)
/*
 * `len` clamped to `max` (a power of two: any other loses bits of `len`), in a
 * form the verifier can bound:
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

/* include/linux/sched.h: set as a task starts to exit, before
 * sched_process_exit (which forgets its interval). */
#define PF_EXITING 0x00000004

struct scratch {
	struct rprof_sample_header hdr;
	__u8 body[RUBY_BYTES + NATIVE_BYTES + KERNEL_BYTES]; /* must follow hdr directly */
	/* Twice the largest read, so a masked length always fits (see CLAMPED). */
	__u8 cfps[2 * CFP_BYTES];
	__u8 vstack[2 * RPROF_VSTACK_WINDOW];
	__u64 ruby_hash; /* of the Ruby frames, for the native program (tail call) */
	__u64 win_lo;	 /* vstack holds the target's [win_lo, win_hi), if not 0 */
	__u64 win_hi;
	__u64 frame_flags; /* ep[0] of the frame walk_frame reads */
	/* ep[-2..0] (me_cref, specval, flags) of an env, and a word it points
	 * to: here, not on the stack, as the kernel's verifier (6.18) fails
	 * with "verifier bug: stack slot 1, total slots 0" on a read into the
	 * stack of block_method_entry. */
	__u64 env[3];
	__u64 env_word;
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

/* A bit per PID that may be in `procs` or `followed`: a clear bit spares
 * the programs that run for every process on the machine (`wall`'s
 * switches, traced system calls, CPU samples) their hash lookups and
 * clock reads, the most of what rprof costs the processes it does not
 * profile. PID_MAX_LIMIT (4,194,304 on 64-bit) is RPROF_PID_WORDS words.
 * Bits are never cleared: a reused PID costs the lookups, as every PID did
 * before. Two maps, one writer each, so that no bit is lost to a race:
 * userspace rewrites its own words (pids_user), BPF sets its bits
 * atomically (pids_bpf, on_fork, on_exec). */
#define PID_MAP                                                                                    \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                                  \
		__uint(max_entries, RPROF_PID_WORDS);                                              \
		__type(key, __u32);                                                                \
		__type(value, __u64);                                                              \
	}

PID_MAP pids_user SEC(".maps");
PID_MAP pids_bpf SEC(".maps");

/* Whether process `tgid` may be followed (0: it is not). A global
 * function, the verifier checks once: inlined in the switch program, it
 * made it 57,000 instructions longer to verify. */
__noinline int may_follow(__u32 tgid)
{
	__u32 word = (tgid >> 6) & (RPROF_PID_WORDS - 1);
	__u64 bit = 1ULL << (tgid & 63), *u = bpf_map_lookup_elem(&pids_user, &word),
	      *k = bpf_map_lookup_elem(&pids_bpf, &word);

	return (((u ? *u : 0) | (k ? *k : 0)) & bit) != 0;
}

/* Marks process `tgid` as maybe followed, before BPF adds it to a map. */
static __always_inline void mark_pid(__u32 tgid)
{
	__u32 word = (tgid >> 6) & (RPROF_PID_WORDS - 1);
	__u64 *k = bpf_map_lookup_elem(&pids_bpf, &word);

	if (k)
		__sync_fetch_and_or(k, 1ULL << (tgid & 63));
}

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
/* wall: set by userspace for its last sweep, which counts GVL waits still
 * open too (earlier sweeps leave them to their switch-in, which splits off
 * their GC time). */
volatile bool wall_final;
/* Set by userspace when the recording ends (bpf_ktime_get_ns's clock), before
 * it detaches: from then on no program counts anything, and the last sweep
 * counts open waits up to this moment. Detaching can take seconds on a busy
 * machine (each tracepoint link waits for an RCU grace period), and what
 * was counted meanwhile made a thread's time longer than the recording. */
volatile __u64 stop_ns;

/* Set by userspace before loading: unwind native (--native) and kernel
 * (--kernel) stacks too. */
const volatile bool native_stacks = false;
const volatile bool kernel_stacks = false;
/* `wall`: CPU samples weigh the time since the thread's last mark, and
 * switches count the time off CPU (on_switch). */
const volatile bool wall_mode = false;
/* --all: a process that execs is followed from then on, whoever it is
 * (userspace looks for a Ruby in it, and lets it go if there is none). */
const volatile bool follow_every_exec = false;
/* alloc: 1 in this many allocations is walked, and weighs this many. */
const volatile __u32 alloc_every = 1;
/* cpu: the ticks' period, set by userspace as it attaches them (0: every
 * sample counts 1; cpu_sample_weight). */
volatile __u64 cpu_period_ns;

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
struct rprof_wall_task rprof_wall_task_type;
struct rprof_wall_thread rprof_wall_thread_type;
struct rprof_wall_slot rprof_wall_slot_type;
struct rprof_wall_seed rprof_wall_seed_type;
struct rprof_kernel_stack rprof_kernel_stack_type;
enum rprof_wall_state rprof_wall_state_type;
enum rprof_wall_object rprof_wall_object_type;
enum rprof_unix_path rprof_unix_path_type;
enum rprof_wall_gc rprof_wall_gc_type;
enum rprof_gc_state rprof_gc_state_type;
enum rprof_alloc_cookie rprof_alloc_cookie_type;
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
	__u64 hash;
	__u64 th; /* the EC's rb_thread_t */
	__u32 n;
	__u32 out;
	__u32 failed;
};

static __always_inline void stat_add(__u32 idx, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v)
		__sync_fetch_and_add(v, n);
}

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

/* s->env: ep[-2..0] (me_cref, specval, flags), from the copied value stack
 * when it is there, else read from the target. */
static __always_inline int read_env(struct scratch *s, __u64 ep)
{
	__u64 lo = ep - 16;

	if (lo >= s->win_lo && ep + 8 <= s->win_hi) {
		__u64 off = lo - s->win_lo;
		const __u64 *src;

		if (off > RPROF_VSTACK_WINDOW - 24)
			return -1;
		src = (const __u64 *)(s->vstack + off);
		s->env[0] = src[0];
		s->env[1] = src[1];
		s->env[2] = src[2];
		return 0;
	}
	return bpf_probe_read_user(s->env, sizeof(s->env), (void *)lo);
}

/* The method entry of a block's frame, whose env (in s->env) is not a
 * method's: up its env chain, as Ruby's rb_vm_frame_method_entry does. A
 * global function, which the verifier checks once: inlined into the frame
 * walk, its loop was checked along every path that reached it, nine tenths
 * of the sample program's checking and most of rprof's start. Methods'
 * frames, most frames, never call it (a call per frame cost 4-10% more per
 * sample at 30 frames). */
__noinline __u64 block_method_entry(struct scratch *s, struct rprof_proc *p)
{
	if (!s || !p)
		return 0;
	for (int depth = 0; depth < RPROF_ENV_CHAIN_MAX; depth++) {
		__u64 cme = s->env[0], ep = s->env[1] & ~3ULL;

		if (s->env[2] & p->env_flag_local)
			return cme; /* cme, a cref userspace will reject, or an svar (see
				       prepare_record) */
		if (cme && !(cme & 7) &&
		    !bpf_probe_read_user(&s->env_word, sizeof(s->env_word), (void *)cme) &&
		    (s->env_word & p->imemo_ment_mask) == p->imemo_ment_value)
			return cme; /* a block run as a method (define_method) */
		if (!ep || depth == RPROF_ENV_CHAIN_MAX - 1 || read_env(s, ep))
			return 0;
	}
	return 0;
}

/* The method entry of a Ruby frame; s->frame_flags gets the frame's own
 * env flags (ep[0]). */
static __always_inline __u64 frame_method_entry(struct scratch *s, struct rprof_proc *p, __u64 ep)
{
	if (read_env(s, ep))
		return 0;
	s->frame_flags = s->env[2];
	if (s->env[2] & p->env_flag_local)
		return s->env[0];
	return block_method_entry(s, p);
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
		s->frame_flags = 0;
		f.cme = frame_method_entry(s, p, ep);
		if (s->frame_flags & p->frame_flag_finish)
			f.flags = RPROF_FRAME_FINISH;
		if (p->cfp_jit_return && cfp_field(s, base, p->cfp_jit_return))
			f.flags |= RPROF_FRAME_JIT;
	} else {
		if (read_env(s, ep))
			return 0;
		if ((s->env[2] & p->frame_magic_mask) != p->frame_magic_cfunc)
			return 0; /* dummy frame at the base of a stack */
		f.cme = s->env[0];
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
	w->th = th;
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
	s->win_lo = 0;
	s->win_hi = 0;
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
			s->win_lo = lo;
			s->win_hi = hi;
		}
	}

	bpf_loop(RPROF_MAX_FRAMES, walk_one, w, 0);
	if (w->failed)
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
	if (s->hdr.flags & RPROF_SAMPLE_TRUNCATED)
		stat_inc(RPROF_STAT_TRUNCATED);
}

/* Whether the marking collection has set its kind: its kind's count is
 * raised (major and minor counts add up to the collection's count). Ruby
 * enters marking first and sets during_minor_gc a few instructions later:
 * a sample between the two saw the last collection's kind (CI found a
 * GC.start(full_mark: true) marking as minor). The counts lie between the
 * flags and the count, in the bytes read_gc_time copied to s->cfps if it
 * read both at once (`copied`; `span` from the flags to the count); else
 * read here. */
static __always_inline bool gc_kind_set(struct rprof_proc *p, struct scratch *s, bool copied,
					__u64 span, __u64 count)
{
	__s64 major_at = (__s64)span + p->gc_major_from_count;
	__s64 minor_at = (__s64)span + p->gc_minor_from_count;
	__u64 major = 0, minor = 0;

	if (!p->gc_major_from_count || !p->gc_minor_from_count)
		return true;
	if (copied && major_at >= 0 && minor_at >= 0) {
		major = *(__u64 *)(s->cfps + (major_at & (CFP_BYTES - 1)));
		minor = *(__u64 *)(s->cfps + (minor_at & (CFP_BYTES - 1)));
	} else if (bpf_probe_read_user(&major, sizeof(major),
				       (void *)(p->gc_count_addr + p->gc_major_from_count)) ||
		   bpf_probe_read_user(&minor, sizeof(minor),
				       (void *)(p->gc_count_addr + p->gc_minor_from_count))) {
		return false;
	}
	return major + minor == count;
}

/* Inside a GC but in no phase: at its start (counted, not yet marking) or
 * at its end; the count does not tell which. */
static __always_inline bool gc_at_edge(__u32 flags)
{
	return (flags & RPROF_GC_DURING_GC) && (flags & RPROF_GC_MODE_MASK) == RPROF_GC_MODE_NONE;
}

/* A reading of the GC's clock made as userspace makes its own (struct
 * rprof_gc_reading), into the record, by the first record of the process
 * at each GC time: a rprof too busy or too starved to read the clock while
 * a GC's time lasted still learns from it whether that GC was major, which
 * naming that time's samples after a later major GC needs (src/gc_time.rs,
 * MajorLog). Four reads, a few times per GC. */
static __always_inline void note_clock(struct rprof_proc *p, struct scratch *s, __u64 time,
				       __u32 *sample_flags)
{
	struct rprof_gc_reading *r = &s->hdr.clock;
	void *major = (void *)(p->gc_count_addr + p->gc_major_from_count);

	if (time == p->clock_sent || !p->gc_major_from_count)
		return;
	if (bpf_probe_read_user(&r->majors_before, sizeof(r->majors_before), major) ||
	    bpf_probe_read_user(&r->count, sizeof(r->count), (void *)p->gc_count_addr) ||
	    bpf_probe_read_user(&r->flags, sizeof(r->flags), (void *)p->gc_flags_addr) ||
	    bpf_probe_read_user(&r->majors_after, sizeof(r->majors_after), major))
		return;
	*sample_flags |= RPROF_SAMPLE_CLOCK;
	/* At a GC's edge the reading does not vouch for that GC: the next
	 * record at this time reads again. */
	if (!gc_at_edge(r->flags))
		p->clock_sent = time;
}

/* The GC's time, read after the frames: they hold still while this thread
 * runs BPF, so the time read now also describes them (src/gc_time.rs). The
 * flags are read before the count, as the GC writes the count first. */
static __always_inline int read_gc_time(struct rprof_proc *p, struct scratch *s, __u64 *time,
					__u32 *sample_flags, __u32 *gc_flags)
{
	__u64 span = p->gc_count_addr - p->gc_flags_addr;
	/* Both words in one read when they are close (they are 0.4 to 1.4 KiB
	 * apart in Ruby 2.7 to 3.4): a read costs more than the bytes it copies. */
	bool copied = p->gc_count_addr > p->gc_flags_addr && span <= CFP_BYTES - 8;
	__u32 flags = 0;
	__u64 count = 0;
	bool marking;

	if (copied) {
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
	if (marking && !gc_kind_set(p, s, copied, span, count))
		flags |= RPROF_GC_KIND_UNSET;
	*time = count * 2 + (marking ? 0 : 1);
	if (gc_at_edge(flags))
		*sample_flags |= RPROF_SAMPLE_GC_EDGE;
	/* Compaction moves objects past marking without a new count. */
	if ((flags & RPROF_GC_DURING_COMPACTING) && !marking)
		*sample_flags |= RPROF_SAMPLE_GC_MOVING;
	*gc_flags = flags;
	note_clock(p, s, *time, sample_flags);
	return 0;
}

/* What the collection under way (objspace `flags`) is doing, if thread `th`
 * of process `tgid` runs it: a collection runs on the thread holding the
 * GVL, and any other thread on a CPU meanwhile runs without it (a blocking
 * region). A global function, which the verifier checks apart from its
 * callers: inlined after the stack walk, its branches doubled the
 * verification of every program that walks (cpu's start-up went from 0.7
 * to 1.2 s). */
__noinline __u32 gc_state_of(__u32 tgid, __u32 flags, __u64 th)
{
	__u32 mode = flags & RPROF_GC_MODE_MASK;
	__u64 base = 0, holder = 0;
	struct rprof_proc *p;

	/* Ruby 2.7 moves objects after its collection has ended, with only
	 * during_compacting set. */
	if (!(flags & (RPROF_GC_DURING_GC | RPROF_GC_DURING_COMPACTING)))
		return RPROF_GC_NONE;
	p = bpf_map_lookup_elem(&procs, &tgid);
	if (!p)
		return RPROF_GC_NONE;
	if (p->th_gvl_base) {
		if (!th ||
		    bpf_probe_read_user(&base, sizeof(base), (void *)(th + p->th_gvl_base)) ||
		    !base ||
		    bpf_probe_read_user(&holder, sizeof(holder), (void *)(base + p->gvl_holder)) ||
		    holder != th)
			return RPROF_GC_NONE;
	}
	if ((flags & RPROF_GC_DURING_COMPACTING) && mode != RPROF_GC_MODE_MARKING)
		return RPROF_GC_COMPACTING;
	if (mode == RPROF_GC_MODE_MARKING && (flags & RPROF_GC_KIND_UNSET))
		return RPROF_GC_MARKING;
	if (mode == RPROF_GC_MODE_MARKING)
		return (flags >> (p->gc_minor_bit & 31)) & 1 ? RPROF_GC_MARKING_MINOR
							     : RPROF_GC_MARKING_MAJOR;
	if (mode == RPROF_GC_MODE_SWEEPING)
		return RPROF_GC_SWEEPING;
	return RPROF_GC_OTHER;
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

	/* Only records carry the thread's name: most events are just counted.
	 * (A record of another task than the current one has its name.) */
	if (!s->hdr.comm[0])
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
	__sync_fetch_and_add(&c->count, s->hdr.weight);
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

/* Whether `leader` started in the tick that `p` was read in: start_ticks
 * without its division, which costs more than the rest of the test, on
 * every event and twice on every context switch in `wall`. */
static __always_inline bool started_as(struct task_struct *leader, struct rprof_proc *p)
{
	return leader->start_boottime - p->start_ticks * RPROF_TICK_NS < RPROF_TICK_NS;
}

#include "native.bpf.h"

/* The offset in a record's body just after its Ruby frames, and after
 * `nnative` native frames; false if over `limit`, the bound of the part
 * written there (never: the counts are clamped, but the verifier wants the
 * check where the offset is used). */
static __always_inline bool body_after(struct scratch *s, __u32 nnative, const __u64 limit,
				       __u64 *off)
{
	__u32 nruby = s->hdr.nframes;
	__u64 o;

	if (nruby > RPROF_MAX_FRAMES)
		nruby = RPROF_MAX_FRAMES;
	if (nnative > RPROF_MAX_NATIVE)
		nnative = RPROF_MAX_NATIVE;
	o = (__u64)nruby * sizeof(struct rprof_frame) +
	    (__u64)nnative * sizeof(struct rprof_native_frame);
	asm volatile("" : "+r"(o));
	if (o > limit)
		return false;
	*off = o;
	return true;
}

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

	__u64 m = mix(mix(mix(mix(mix(mix(mix(frames_hash, ((__u64)h->tid << 32) | h->event),
					  h->flags & ~RPROF_SAMPLE_CLOCK),
				      h->nframes),
				  h->gc_time),
			      h->ruby_thread),
			  h->start_ticks),
		      ((__u64)(h->wall_state | h->wall_object << 8 | h->gc_state << 16) << 32) |
			  (__u32)h->wall_syscall);

	/* Unconditionally (zero but for a socket's wait): a branch here would be
	 * one more path in every program that counts. */
	m = mix(mix(mix(mix(m, (__u64)h->local_port << 32 | h->peer_family << 16 | h->peer_port),
			*(__u64 *)h->peer_addr),
		    *(__u64 *)(h->peer_addr + 8)),
		h->alloc_class ^ ((__u64)h->alloc_type << 58));
	h->hash = finish_hash(m);
	count_stack(s);
}

/* A record's header, before its stack is read. */
static __always_inline void begin(struct scratch *s, struct rprof_proc *p, __u32 tgid, __u32 tid,
				  __u32 event)
{
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
	s->hdr.wall_state = 0;
	s->hdr.wall_syscall = -1;
	s->hdr.wall_object = 0;
	s->hdr.gc_state = 0;
	s->hdr.peer_family = 0;
	s->hdr.peer_port = 0;
	s->hdr.local_port = 0;
	__builtin_memset(s->hdr.peer_addr, 0, sizeof(s->hdr.peer_addr));
	s->hdr.weight = 1;
	s->hdr.alloc_class = 0;
	s->hdr.alloc_type = 0;
	s->hdr.comm[0] = 0;
}

/* The Ruby stack of the current task, whose thread pointer is `tp`: its
 * frames into the record, their hash into w->hash (0 and no frames if they
 * could not be read). */
static __always_inline void read_stack(struct walk_ctx *w, __u64 tp, __u32 tgid)
{
	struct scratch *s = w->s;
	__u64 ec = 0;

	if (read_ec(w->p, tgid, tp, &ec)) {
		s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
	} else if (!ec) {
		s->hdr.flags |= RPROF_SAMPLE_NO_EC;
		stat_inc(RPROF_STAT_NO_EC);
	} else {
		__u32 gc_flags = 0;

		walk_stack(w, ec, tp);
		if (w->out && read_gc_time(w->p, s, &s->hdr.gc_time, &s->hdr.flags, &gc_flags))
			s->hdr.flags |= RPROF_SAMPLE_READ_FAILED;
		else
			s->hdr.gc_state = gc_state_of(s->hdr.pid, gc_flags, w->th);
	}
	if (s->hdr.flags & RPROF_SAMPLE_READ_FAILED) {
		stat_inc(RPROF_STAT_READ_FAILED);
		w->out = 0; /* a partial stack would lie */
		w->hash = 0;
	}
	if (s->hdr.flags & RPROF_SAMPLE_FOREIGN_EC)
		stat_inc(RPROF_STAT_FOREIGN_EC);
	s->hdr.nframes = w->out;
}

/* wall: each followed thread's open interval (struct rprof_wall_task). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct rprof_wall_task);
	/* Allocated as threads are seen: preallocated, it would take 12 MiB. */
	__uint(map_flags, BPF_F_NO_PREALLOC);
} wall_tasks SEC(".maps");

/* wall: by thread id modulo RPROF_PID_WORDS, the thread that last opened
 * a GVL wait with a GC clock to read at its wakeup: on_waking, which runs
 * at every wakeup on the machine, looks no further for any other. Two such
 * waits whose thread ids collide at once (65,536 apart) leave the first's
 * clock to be read as if it were woken from outside its process (the owed
 * path of wall_in and settle_owed). */
#define TID_SLOTS                                                                                  \
	struct {                                                                                   \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                                  \
		__uint(max_entries, RPROF_PID_WORDS);                                              \
		__type(key, __u32);                                                                \
		__type(value, __u32);                                                              \
	}

TID_SLOTS gvl_waiters SEC(".maps");

/* The slot of thread `tid` in a TID_SLOTS map. */
static __always_inline __u32 *tid_slot(void *map, __u32 tid)
{
	__u32 slot = tid & (RPROF_PID_WORDS - 1);

	return bpf_map_lookup_elem(map, &slot);
}

#define ON_CPU 1ULL
/* A mark read once: the compare-and-swap must expect the value tested, not
 * one the compiler reloads after another CPU changed it. */
#define READ_MARK(e) (*(volatile __u64 *)&(e)->mark)

/* wall: the stacks userspace read of waits the sweep found with none (key:
 * tid), for the wait that began at the seed's mark. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct rprof_wall_seed);
} wall_seeds SEC(".maps");

/* wall: the stack the wait that began at `mark` counts to: known, or given
 * by userspace for this very wait; 0 if neither yet. */
static __always_inline __u64 seeded_hash(struct rprof_wall_task *e, __u32 tid, __u64 mark)
{
	struct rprof_wall_seed *seed;

	if (e->hash)
		return e->hash;
	seed = bpf_map_lookup_elem(&wall_seeds, &tid);
	if (!seed || seed->mark != mark)
		return 0;
	e->hash = seed->hash;
	return e->hash;
}

/* wall: `ns` for stack `hash`, which the counts map has no room for, sent
 * on its own for userspace to add to the stack it named by that hash. */
static __always_inline void send_time(__u64 hash, __u64 ns)
{
	struct rprof_sample_header *h = bpf_ringbuf_reserve(&samples, sizeof(*h), 0);

	if (!h) {
		stat_add(RPROF_STAT_WALL_LOST, ns);
		return;
	}
	__builtin_memset(h, 0, sizeof(*h));
	h->kind = RPROF_RECORD_SAMPLE;
	h->hash = hash;
	h->flags = RPROF_SAMPLE_DIRECT | RPROF_SAMPLE_BY_HASH;
	h->weight = ns;
	stat_inc(RPROF_STAT_AGG_FULL);
	bpf_ringbuf_submit(h, wakeup_flags());
}

/* wall: adds `ns` to a stack whose record was sent when its interval began
 * (userspace keeps the stacks of open intervals named across epochs). */
static __always_inline void add_time(__u64 hash, __u64 ns)
{
	struct rprof_stack_count *c = 0, init = {.count = ns};
	__u32 live = epoch & 1;
	void *map = bpf_map_lookup_elem(&counts, &live);
	long err;

	if (!map || !ns)
		return;
	c = bpf_map_lookup_elem(map, &hash);
	if (!c) {
		err = bpf_map_update_elem(map, &hash, &init, BPF_NOEXIST);
		if (!err)
			return;
		if (err == -EEXIST)
			c = bpf_map_lookup_elem(map, &hash);
	}
	if (c)
		__sync_fetch_and_add(&c->count, ns);
	else
		send_time(hash, ns);
}

/* wall: the index of the thread's slot for time of kind `key`, taken if it
 * has none yet; RPROF_WALL_SLOTS if all are taken. A global function, which
 * the verifier checks once: inlined, its loop was checked at each of the
 * switch program's many paths to it (a quarter of that program's checking). */
__noinline __u64 slot_index(struct rprof_wall_task *e, __u32 key)
{
	__u32 i;

	for (i = 0; e && i < RPROF_WALL_SLOTS; i++) {
		struct rprof_wall_slot *sl = &e->slots[i];

		if (sl->key == key)
			return i;
		if (!sl->key) {
			sl->hash = 0;
			sl->key = key;
			return i;
		}
	}
	return RPROF_WALL_SLOTS;
}

/* wall: the thread's slot for time of kind `key`, taken if it has none
 * yet; 0 if all are taken (its time is then walked every time). */
static __always_inline struct rprof_wall_slot *slot_of(struct rprof_wall_task *e, __u32 key)
{
	__u64 i = slot_index(e, key);

	/* Masked: the verifier knows nothing of a global function's result,
	 * and clang computes the address before the test. */
	return i < RPROF_WALL_SLOTS ? &e->slots[i & (RPROF_WALL_SLOTS - 1)] : 0;
}

/* wall: time whose stack is not known yet: pending in the slot of its kind
 * (running, or a wait not walked), which userspace shares among the stacks
 * of that kind; unseen if the thread has no slot for it. */
static __always_inline void unpend(struct rprof_wall_slot *sl, __u64 ns)
{
	if (sl)
		__sync_fetch_and_add(&sl->pending, ns);
	else
		stat_add(RPROF_STAT_WALL_UNSEEN, ns);
}

/* wall: by thread id modulo RPROF_PID_WORDS, the thread whose wait last
 * opened after a walk: on_waking looks no further for whether the thread
 * that wakes it is the one its switch-out handed the CPU to (walk_part). */
TID_SLOTS walk_waiters SEC(".maps");

/* wall: the time the walk of `e`'s wait held the CPU, taken as the wait is
 * counted: what of it is the wait's. The walk delays what the CPU runs next,
 * not what runs elsewhere: a wait ended from another CPU (a reply, a
 * timer) ends when it would have, and began at the switch-out, so the
 * walk's time is part of it; a wait ended by the thread switched to (two
 * threads handing one CPU back and forth) ends as much later as the walk
 * took, and began after it, so that time counts as running. Either way a
 * walked wait lasts as long as the others, whose split the walked ones
 * estimate. */
static __always_inline __u64 walk_part(struct rprof_wall_task *e)
{
	__u64 ns = __sync_lock_test_and_set(&e->walk_ns, 0);

	if (!ns || !e->walk_by_next)
		return ns;
	unpend(slot_of(e, RPROF_WALL_KEY(RPROF_WALL_RUNNING, -1)), ns);
	return 0;
}

static __always_inline void missed_gvl_wait(struct rprof_proc *p, struct rprof_wall_task *e,
					    __u64 hash, __u64 start, __u64 ns, __u64 ran);

/* wall: the thread runs, but its mark says it waits: the kernel ran it
 * with no switch-in rprof saw (seen here: a task whose own switches are not
 * traced, a host agent, handed the CPU back). When its wait ended is not
 * known, but its CPU time since the mark says how much of the interval it
 * ran: that is returned, to count as running, and the rest counts to the
 * wait (pending in its slot: the stack has changed since), so that its time
 * still adds up. A GVL wait is split by the GC's clock as at a switch-in
 * (missed_gvl_wait). Runs in the thread's own context (its switch-out or
 * CPU sample), so its process's memory is the current one. */
static __always_inline __u64 missed_switch_in(struct rprof_proc *p, struct rprof_wall_task *e,
					      __u32 tid, struct task_struct *task, __u64 mark,
					      __u64 now)
{
	__u64 total = ((mark >> 1) < now ? now - (mark >> 1) : 0) + walk_part(e);
	__u64 ran = task->se.sum_exec_runtime - e->exec, hash;
	struct rprof_wall_slot *sl = 0;

	if (ran > total)
		ran = total;
	stat_inc(RPROF_STAT_WALL_MISSED_IN);
	hash = seeded_hash(e, tid, mark);
	if (e->state == RPROF_WALL_GVL && e->gc_at) {
		missed_gvl_wait(p, e, hash, mark >> 1, total - ran, ran);
		return ran;
	}
	if (!hash && e->state)
		sl = slot_of(e, RPROF_WALL_KEY(e->state, e->syscall));
	if (hash)
		add_time(hash, total - ran);
	else if (sl)
		__sync_fetch_and_add(&sl->pending, total - ran);
	else
		stat_add(RPROF_STAT_WALL_UNSEEN, total - ran);
	return ran;
}

/* wall: a new thread interval's first values, written here rather than on
 * the stack (a struct rprof_wall_task is too big for it beside a walk).
 * One entry per context that may interrupt another on a CPU. */
enum wall_fresh_slot { FRESH_SWITCH = 0, FRESH_SAMPLE = 1, FRESH_SWEEP = 2 };

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 3);
	__type(key, __u32);
	__type(value, struct rprof_wall_task);
} wall_fresh SEC(".maps");

/* wall: opens thread `tid`'s first interval at `mark` unless it has one
 * (callers that need the entry look it up). Whether this call added it. */
static __always_inline bool add_wall_task(__u32 tid, __u32 slot, __u64 mark, __u64 window_at,
					  __u64 exec)
{
	struct rprof_wall_task *t = bpf_map_lookup_elem(&wall_fresh, &slot);

	if (!t)
		return false;
	__builtin_memset(t, 0, sizeof(*t));
	t->mark = mark;
	t->window_at[0] = window_at;
	t->window_at[1] = window_at;
	t->exec = exec;
	return !bpf_map_update_elem(&wall_tasks, &tid, t, BPF_NOEXIST);
}

/* wall: the GC's own clock (GC.stat(:time), ns) plus 1, of the process
 * whose memory is the current one; 0 if it has none or cannot be read. */
static __always_inline __u64 gc_clock_at(struct rprof_proc *p)
{
	__u64 a = 0, b = 0;

	if (!p->gc_time_addr[0] || bpf_probe_read_user(&a, sizeof(a), (void *)p->gc_time_addr[0]) ||
	    (p->gc_time_addr[1] && bpf_probe_read_user(&b, sizeof(b), (void *)p->gc_time_addr[1])))
		return 0;
	return a + b + 1;
}

/* wall: the GC's clock for a thread's owed GVL wait (settle_owed), at its
 * first CPU sample after the wait. A thread that takes the GVL as the wait
 * ends may run a whole time slice (Ruby 3.1: 100 ms) before it switches
 * out, and all of that CPU time is left out of the wait's GC part there:
 * a collection that ran in the wait, shorter than the slice, would count
 * for nothing. Here the CPU time left out is at most a sampling period. */
static __always_inline void note_owed_clock(struct rprof_proc *p, struct rprof_wall_task *e,
					    struct task_struct *task)
{
	__u64 clock = gc_clock_at(p);

	if (!clock)
		return;
	e->owed_ran = task->se.sum_exec_runtime - e->owed_exec;
	e->owed_clock = clock;
}

/* wall: what a CPU sample of thread `e` counts (wall_sample_weight), which
 * ran `ran` ns since its last mark: 1, with that time pending in its running
 * slot; its own time if it has no slot (nor then pending time to share). */
static __always_inline __u64 sample_count(struct rprof_wall_task *e, __u64 ran)
{
	struct rprof_wall_slot *run = e ? slot_of(e, RPROF_WALL_KEY(RPROF_WALL_RUNNING, -1)) : 0;

	if (!run)
		return ran;
	if (!ran)
		return 0;
	__sync_fetch_and_add(&run->pending, ran - 1);
	return 1;
}

/* wall: a CPU sample counts 1 (ns) to the stack it finds; the thread's time
 * on CPU since its last mark (its switch-in, or its previous sample) joins
 * the rest of its running time in its running slot, which userspace shares
 * among the stacks its samples found, in proportion to their counts (as
 * waits not walked are shared). Ticks fall evenly over CPU time, so a
 * method's share of the samples is its share of the time; a sample weighed
 * by the time since the one before would also take what ran unsampled
 * before it, across waits, in other methods. Running time adds up exactly. */
static __always_inline __u64 wall_sample_weight(struct rprof_proc *p, __u32 tid,
						struct task_struct *task)
{
	struct rprof_wall_task *e = bpf_map_lookup_elem(&wall_tasks, &tid);
	__u64 now = bpf_ktime_get_ns(), since, ran;

	if (!e) {
		/* Running since before rprof saw it switch: since it was followed. */
		since = task->start_time > p->wall_since ? task->start_time : p->wall_since;
		add_wall_task(tid, FRESH_SAMPLE, (now << 1) | ON_CPU, 0, 0);
		ran = since < now ? now - since : 0;
		return sample_count(bpf_map_lookup_elem(&wall_tasks, &tid), ran);
	}
	if (e->owed_ns && !e->owed_clock)
		note_owed_clock(p, e, task);
	since = __sync_lock_test_and_set(&e->mark, (now << 1) | ON_CPU);
	if (!(since & ON_CPU))
		ran = missed_switch_in(p, e, tid, task, since, now);
	else
		ran = (since >> 1) < now ? now - (since >> 1) : 0;
	return sample_count(e, ran);
}

/* wall: the sample's stack is its thread's running slot's now. (Looked up
 * again after the walk: a slot pointer kept across it would have the
 * verifier check the walk once per slot.) */
static __always_inline void wall_sampled(__u32 tid, __u64 hash)
{
	struct rprof_wall_task *e = bpf_map_lookup_elem(&wall_tasks, &tid);
	struct rprof_wall_slot *run = e ? slot_of(e, RPROF_WALL_KEY(RPROF_WALL_RUNNING, -1)) : 0;

	if (run)
		run->hash = hash;
}

/* A word of the rb_thread_t copied into s->cfps. */
static __always_inline __u64 th_word(struct scratch *s, __u32 off)
{
	return *(__u64 *)(s->cfps + (off & 511));
}

/* wall: why the current thread, which is leaving the CPU and not runnable,
 * waits: from its rb_thread_t (see offcpu notes in ARCHITECTURE.md §9). */
static __always_inline __u32 wall_reason(struct rprof_proc *p, struct scratch *s, __u64 th)
{
	__u64 base, holder = 0, next;
	__u32 status;
	__u8 byte;

	if (!th || !p->th_status_mask || !p->th_read_len)
		return RPROF_WALL_OFF_CPU;
	if (bpf_probe_read_user(s->cfps, p->th_read_len & 511, (void *)th))
		return RPROF_WALL_OFF_CPU;
	next = th_word(s, p->th_gvl_node);
	if (next && next != th + p->th_gvl_node &&
	    !(p->th_gvl_node_ubf && th_word(s, p->th_unblock_func)))
		return RPROF_WALL_GVL;
	/* In a blocking region, sleeping or stopped, a thread has released the
	 * GVL: only a runnable one outside them may block holding it. */
	if (th_word(s, p->th_blocking_region))
		return RPROF_WALL_BLOCKED;
	byte = s->cfps[p->th_status_byte & 511];
	status = (byte >> (p->th_status_shift & 7)) & p->th_status_mask;
	switch (status) {
	case 0: /* THREAD_RUNNABLE: taking the GVL, or blocked holding it */
		base = th_word(s, p->th_gvl_base);
		if (base &&
		    bpf_probe_read_user(&holder, sizeof(holder), (void *)(base + p->gvl_holder)))
			holder = 0;
		return holder == th ? RPROF_WALL_GVL_HELD : RPROF_WALL_GVL;
	case 1: /* THREAD_STOPPED */
		return RPROF_WALL_SLEEP;
	case 2: /* THREAD_STOPPED_FOREVER */
		return th_word(s, p->th_locking_mutex) ? RPROF_WALL_MUTEX : RPROF_WALL_WAIT;
	default:
		return RPROF_WALL_OFF_CPU;
	}
}

/* The system call `task` is in, or -1. */
static __always_inline __s32 syscall_of(struct task_struct *task)
{
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);

	return regs ? (__s32)regs->orig_ax : -1;
}

/* include/uapi/linux/stat.h */
#define S_IFMT	 00170000
#define S_IFSOCK 0140000
#define S_IFREG	 0100000
#define S_IFCHR	 0020000
#define S_IFIFO	 0010000

/* wall: the stack of a wait that begins, to walk: that of `task`, the
 * current task. */
struct wall_walk {
	__u64 task; /* struct task_struct *, read with probes */
	__u32 tgid; /* 0: nothing to walk */
	__u32 tid;
	__u32 state;
	__s32 syscall;
	__u32 object;
	__u16 peer_family;
	__u16 peer_port;
	__u8 peer_addr[16];
	__u16 local_port;
};

#define AF_UNIX	   1
#define AF_INET	   2
#define AF_INET6   10
#define TCP_LISTEN 10
/* sizeof(((struct sockaddr_un *)0)->sun_path) */
#define UNIX_PATH_BYTES 108

/* A Unix socket's path, read where the kernel keeps it (`unix_address`). */
struct unix_path_bytes {
	__u8 b[UNIX_PATH_BYTES];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct unix_path_bytes);
} unix_path_scratch SEC(".maps");

/* The FNV-1a hash of the path `addr` (a struct unix_address *) names, as
 * /proc/net/unix shows it: up to its NUL, or an abstract name's bytes with
 * `@` for each NUL. */
__noinline __u64 unix_path_hash(__u64 addr)
{
	struct unix_address *a = (struct unix_address *)addr;
	__u32 zero = 0;
	struct unix_path_bytes *p = bpf_map_lookup_elem(&unix_path_scratch, &zero);
	__s32 len = BPF_CORE_READ(a, len) - (__s32)sizeof(__u16);
	__u64 h = 0xcbf29ce484222325ULL;
	bool abstract;
	__u32 n;

	if (!p || len <= 0)
		return 0;
	/* Its bytes only: the address is allocated to its length. */
	n = len < UNIX_PATH_BYTES ? len : UNIX_PATH_BYTES;
	if (bpf_probe_read_kernel(p->b, n, a->name[0].sun_path))
		return 0;
	abstract = p->b[0] == 0;
	for (__u32 i = 0; i < UNIX_PATH_BYTES && i < n; i++) {
		__u8 c = p->b[i];

		if (c == 0 && !abstract)
			break;
		h = (h ^ (c ? c : '@')) * 0x100000001b3ULL;
	}
	return h;
}

/* A Unix socket `sock` (a struct sock *) into `r`: the path it listens
 * on, was accepted on or is bound to, else the path of the socket it is
 * connected to (a client's end has no path of its own: the server's end of
 * its connection has the listener's). Global functions, both: the verifier
 * checks them once (inlined, on every path to them, on_switch took 75,000
 * more instructions to verify, 50 ms more of rprof's start). */
__noinline int unix_path(__u64 sock, struct wall_walk *r)
{
	struct sock *sk = (struct sock *)sock;
	struct unix_address *a = BPF_CORE_READ((struct unix_sock *)sk, addr);
	__u16 whose = RPROF_UNIX_PATH_OWN;
	__u64 hash;

	if (a && BPF_CORE_READ(sk, __sk_common.skc_state) == TCP_LISTEN)
		whose = RPROF_UNIX_PATH_LISTENING;
	if (!a) {
		struct sock *peer = BPF_CORE_READ((struct unix_sock *)sk, peer);

		a = peer ? BPF_CORE_READ((struct unix_sock *)peer, addr) : 0;
		whose = RPROF_UNIX_PATH_PEER;
	}
	hash = a ? unix_path_hash((__u64)a) : 0;
	if (!hash || !r)
		return 0;
	r->peer_port = whose;
	__builtin_memcpy(r->peer_addr, &hash, sizeof(hash));
	return 0;
}

/* The peer of the IP socket `file` into `r` (its listening port if it
 * listens): the label of a wait on it, `(socket 10.0.0.7:5432)`; of a Unix
 * socket, its path (`unix_path`). */
static __always_inline __u32 socket_peer(struct file *file, struct wall_walk *r)
{
	struct socket *sock = BPF_CORE_READ(file, private_data);
	struct sock *sk = sock ? BPF_CORE_READ(sock, sk) : 0;
	__u16 family;

	if (!sk)
		return RPROF_WALL_OBJECT_SOCKET;
	family = BPF_CORE_READ(sk, __sk_common.skc_family);
	r->peer_family = family;
	if (family == AF_UNIX) {
		unix_path((__u64)sk, r);
		return RPROF_WALL_OBJECT_SOCKET;
	}
	if (family != AF_INET && family != AF_INET6)
		return RPROF_WALL_OBJECT_SOCKET;
	if (BPF_CORE_READ(sk, __sk_common.skc_state) == TCP_LISTEN) {
		r->peer_port = BPF_CORE_READ(sk, __sk_common.skc_num);
		return RPROF_WALL_OBJECT_LISTENING;
	}
	r->peer_port = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
	/* TCP's only: a connection accepted on a port is named by it. */
	if (BPF_CORE_READ(sk, sk_protocol) == IPPROTO_TCP)
		r->local_port = BPF_CORE_READ(sk, __sk_common.skc_num);
	/* Whole addresses: BPF_CORE_READ_INTO into an array copies one element. */
	if (family == AF_INET)
		bpf_core_read(r->peer_addr, 4, &sk->__sk_common.skc_daddr);
	else
		bpf_core_read(r->peer_addr, 16, &sk->__sk_common.skc_v6_daddr);
	return RPROF_WALL_OBJECT_SOCKET;
}

/* Which file `f` (a struct file *), open as `fd`, is, into `r`'s peer
 * address: its inode, its file system's device and the descriptor, by
 * which userspace finds its path (and checks that the descriptor still
 * names it). Global, as `unix_path`: inlined, it took on_switch 74,000 more
 * instructions to verify. */
__noinline int file_identity(__u64 f, __s64 fd, struct wall_walk *r)
{
	struct file *file = (struct file *)f;
	__u64 inode = BPF_CORE_READ(file, f_inode, i_ino);
	__u32 dev = BPF_CORE_READ(file, f_inode, i_sb, s_dev);
	__u32 n = fd;

	if (!r)
		return 0;
	__builtin_memcpy(r->peer_addr, &inode, sizeof(inode));
	__builtin_memcpy(r->peer_addr + 8, &dev, sizeof(dev));
	__builtin_memcpy(r->peer_addr + 12, &n, sizeof(n));
	return 0;
}

/* The open file `fd` of `task`, or 0. */
static __always_inline struct file *file_of(struct task_struct *task, __u64 fd)
{
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	struct file *file = 0, **fds;

	if (!fdt || fd >= BPF_CORE_READ(fdt, max_fds))
		return 0;
	fds = BPF_CORE_READ(fdt, fd);
	if (bpf_probe_read_kernel(&file, sizeof(file), fds + fd))
		return 0;
	return file;
}

/* Whether `file` is an eventfd: its name "[eventfd]" ("anon_inode:[eventfd]"
 * in /proc/PID/fd). */
static __always_inline bool is_eventfd(struct file *file)
{
	static const char want[10] = "[eventfd]";
	char name[10] = {};

	if (!file || bpf_probe_read_kernel_str(
			 name, sizeof(name), BPF_CORE_READ(file, f_path.dentry, d_name.name)) != 10)
		return false;
#pragma unroll
	for (int i = 0; i < 9; i++)
		if (name[i] != want[i])
			return false;
	return true;
}

/* The descriptor a poll of `nfds` descriptors at `ufds` waits on, or -1:
 * Ruby waits for one descriptor, and on 2.7-3.2 the thread that holds the
 * VM's signal eventfd (sigwait_fd, one thread at a time) polls it second. */
static __always_inline __s64 polled_fd(struct task_struct *task, void *ufds, __u64 nfds)
{
	struct {
		__s32 fd;
		__s16 events, revents;
	} fds[2] = {};

	if (nfds < 1 || nfds > 2 || bpf_probe_read_user(fds, nfds * sizeof(fds[0]), ufds) ||
	    fds[0].fd < 0)
		return -1;
	if (nfds == 2 && !is_eventfd(file_of(task, fds[1].fd)))
		return -1;
	return fds[0].fd;
}

/* The most descriptors a select is read for: one of more is not named. */
#define SELECT_MAX_FDS 8192

/* The descriptors a select waits on, gathered a word (64 of them) at a
 * time: the first two found, and how many there are (3: more than two, or
 * unreadable). */
struct select_scan {
	__u64 sets[2]; /* read and write sets (user addresses; 0: none) */
	__u64 bytes;   /* of each set: the kernel reads this much of them */
	__s64 fds[2];
	__u32 n;
};

/* The index of the lowest bit set in `w` (not 0): the bits below it,
 * counted without a branch (each branch would double the paths the
 * verifier walks). */
static __always_inline __u32 lowest_bit(__u64 w)
{
	__u64 x = (w & -w) - 1;

	x = x - ((x >> 1) & 0x5555555555555555ULL);
	x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
	x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
	return (x * 0x0101010101010101ULL) >> 56;
}

/* bpf_loop: word `i` of the sets (of both: a descriptor waited on for
 * reading and writing is one). */
static long select_word(__u32 i, struct select_scan *c)
{
	__u64 off = (__u64)i * 8, w = 0, v;

	/* (The verifier walks this as if called again whatever it returns:
	 * the count must stop at 3 for its states to repeat.) */
	if (off >= c->bytes || c->n > 2)
		return 1;
	for (int k = 0; k < 2; k++) {
		v = 0;
		if (c->sets[k] && bpf_probe_read_user(&v, sizeof(v), (void *)(c->sets[k] + off))) {
			c->n = 3;
			return 1;
		}
		w |= v;
	}
	for (int k = 0; k < 3 && w; k++) {
		if (c->n < 2)
			c->fds[c->n & 1] = off * 8 + lowest_bit(w);
		if (c->n < 3)
			c->n++;
		w &= w - 1;
	}
	return c->n > 2;
}

/* The scan of a select's sets, into `out`. Global: the verifier checks it
 * once, not on each path of the switch program. */
__noinline int scan_select(struct select_scan *out)
{
	struct select_scan c; /* bpf_loop's context must be on this stack */

	if (!out)
		return 0;
	__builtin_memcpy(&c, out, sizeof(c));
	bpf_loop(SELECT_MAX_FDS / 64, select_word, &c, 0);
	__builtin_memcpy(out, &c, sizeof(c));
	return 0;
}

/* The descriptor a select of `nfds` descriptors (read set at `rset`, write
 * set at `wset`) waits on, or -1: as for a poll (polled_fd), one, or one
 * beside Ruby 2.7-3.2's signal eventfd, which its holder adds to the read
 * set. */
static __always_inline __s64 selected_fd(struct task_struct *task, __u64 nfds, __u64 rset,
					 __u64 wset)
{
	struct select_scan c = {.sets = {rset, wset}, .bytes = (nfds + 63) / 64 * 8};

	if (nfds < 1 || nfds > SELECT_MAX_FDS)
		return -1;
	scan_select(&c);
	if (c.n == 1)
		return c.fds[0];
	if (c.n != 2)
		return -1;
	if (is_eventfd(file_of(task, c.fds[0])))
		return c.fds[1];
	return is_eventfd(file_of(task, c.fds[1])) ? c.fds[0] : -1;
}

/* wall: what the system call `task`, the current task, is blocked in waits
 * on: the kind of its file descriptor (x86-64 system call numbers), and
 * into `r` a socket's peer. */
static __always_inline __u32 object_of(struct task_struct *task, __s32 syscall, struct wall_walk *r)
{
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	struct file *file;
	__u32 mode;
	__s64 fd;

	if (!regs)
		return RPROF_WALL_OBJECT_NONE;
	switch (syscall) {
	case 0 ... 1:	/* read, write */
	case 17 ... 20: /* pread64, pwrite64, readv, writev */
	case 42 ... 47: /* connect, accept, sendto, recvfrom, sendmsg, recvmsg */
	case 72 ... 75: /* fcntl, flock, fsync, fdatasync */
	case 288:	/* accept4 */
		fd = BPF_CORE_READ(regs, di);
		break;
	case 7:	  /* poll */
	case 271: /* ppoll */
		fd = polled_fd(task, (void *)BPF_CORE_READ(regs, di), BPF_CORE_READ(regs, si));
		break;
	case 23:  /* select */
	case 270: /* pselect6 */
		fd = selected_fd(task, BPF_CORE_READ(regs, di), BPF_CORE_READ(regs, si),
				 BPF_CORE_READ(regs, dx));
		break;
	default:
		return RPROF_WALL_OBJECT_NONE;
	}
	file = fd < 0 ? 0 : file_of(task, fd);
	if (!file)
		return RPROF_WALL_OBJECT_NONE;
	mode = BPF_CORE_READ(file, f_inode, i_mode) & S_IFMT;
	/* A file, device or pipe: what names it (whatever else is not a socket
	 * gets it too, named by nothing). One condition, not three: with
	 * three, on_switch took 95,000 more instructions to verify. */
	if (mode != S_IFSOCK)
		file_identity((__u64)file, fd, r);
	switch (mode) {
	case S_IFSOCK:
		return socket_peer(file, r);
	case S_IFIFO:
		return RPROF_WALL_OBJECT_PIPE;
	case S_IFREG:
		return RPROF_WALL_OBJECT_FILE;
	case S_IFCHR:
		return RPROF_WALL_OBJECT_DEVICE;
	default:
		return RPROF_WALL_OBJECT_NONE;
	}
}

/* The programs on_event continues in with --native/--kernel: one array per
 * kind of program (an array serves programs of one type). Userspace fills
 * the one in use: only the programs of the recording's kind are loaded, and
 * a static initializer would name one that is not. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} tail_perf_event SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} tail_tracepoint SEC(".maps");

/* How an event came: `kind` is a constant at each call, as a program may
 * only use the program array of its own type. */
enum event_kind { EVENT_SAMPLE, EVENT_TRACEPOINT, EVENT_ALLOC };

/* enum ruby_value_type's T_IMEMO (Ruby 2.7 to 3.4): internal objects. */
#define T_IMEMO 0x1a

/* alloc: the object allocated, as the probe's function was given it. */
struct allocation {
	__u64 klass;
	__u32 type;
};

/* cpu: how much of a thread's CPU time (its sum_exec_runtime) its samples
 * stand for. */
struct cpu_account {
	__u64 counted;
	__u64 exec_id; /* the program it ran then (an exec starts anew) */
	__u64 started; /* counted is set */
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct cpu_account);
} cpu_accounts SEC(".maps");

/* cpu: what a sample counts. Each CPU's ticks come at fixed moments, and
 * rprof's work on what they took follows them, so ticks find rprof less or
 * more often than its share of the CPUs: a Puma worker rprof displaced got
 * from 0.88 to 1.10 of the samples its CPU time gives (tests/servers.rs).
 * So each thread's samples are kept to its CPU time: a sample counts 1;
 * none when the thread's samples are ahead of its CPU time by more than a
 * period and CPU_SLACK_NS; more when they are behind by more, down to that.
 * CPU_SLACK_NS covers how stale sum_exec_runtime may be: the scheduler adds
 * to it at its own ticks, at most 10 ms apart (HZ=100), so a thread found
 * at every tick counts 1 at each. */
#define CPU_SLACK_NS 10000000ULL

static __always_inline __u64 cpu_sample_weight(struct task_struct *task)
{
	__u64 ran = task->se.sum_exec_runtime, period = cpu_period_ns;
	__u64 slack = period + CPU_SLACK_NS, extra;
	struct cpu_account *a;
	__s64 behind;

	if (!period)
		return 1;
	a = bpf_task_storage_get(&cpu_accounts, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!a)
		return 1;
	if (!a->started || a->exec_id != task->self_exec_id) {
		a->counted = ran;
		a->exec_id = task->self_exec_id;
		a->started = 1;
		return 1;
	}
	/* The CPU time a count of 1 leaves uncounted (negative: counted ahead). */
	behind = (__s64)(ran - a->counted) - (__s64)period;
	if (behind < -(__s64)slack)
		return 0;
	if (behind <= (__s64)slack) {
		a->counted += period;
		return 1;
	}
	extra = ((__u64)behind - slack) / period + 1;
	a->counted += (1 + extra) * period;
	return 1 + extra;
}

static __always_inline int on_event(void *ctx, __u32 event, const enum event_kind kind,
				    const struct allocation *alloc)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id, slot;
	struct rprof_proc *p;
	struct scratch *s;
	struct walk_ctx w = {};
	struct task_struct *task;
	__u64 weight = 1;

	if (stop_ns || !may_follow(tgid))
		return 0;
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
	if (!started_as(task->group_leader, p)) {
		stat_inc(RPROF_STAT_OTHER_PROCESS);
		return 0;
	}
	if (kind == EVENT_SAMPLE && !wall_mode) {
		weight = cpu_sample_weight(task);
		if (!weight) {
			stat_inc(RPROF_STAT_CPU_SKIPPED);
			return 0;
		}
		if (weight > 1)
			stat_add(RPROF_STAT_CPU_ADDED, weight - 1);
	}
	stat_add(RPROF_STAT_EVENTS, weight);
	slot = bpf_get_smp_processor_id() * 2 + (event ? 1 : 0);
	s = bpf_map_lookup_elem(&scratch, &slot);
	if (!s)
		return 0;

	if (wall_mode && (task->flags & PF_EXITING))
		return 0; /* its time was counted when it began to exit */
	begin(s, p, tgid, tid, event);
	s->hdr.weight = weight;
	if (kind == EVENT_ALLOC) {
		s->hdr.alloc_class = alloc->klass;
		s->hdr.alloc_type = alloc->type;
		s->hdr.weight = alloc_every;
	}
	if (wall_mode) {
		s->hdr.weight = wall_sample_weight(p, tid, task);
		s->hdr.wall_state = RPROF_WALL_RUNNING;
	}
	w.s = s;
	w.p = p;
	read_stack(&w, task->thread.fsbase, tgid);
	if ((native_stacks || kernel_stacks) && kind != EVENT_ALLOC) {
		/* The native and kernel stacks in a program of their own, which
		 * the verifier checks apart from this one. */
		s->ruby_hash = w.hash;
		/* Said if the tail call cannot be made (it always can). */
		s->hdr.native_stop = native_stacks ? RPROF_NATIVE_NO_SPACE : 0;
		if (kind == EVENT_TRACEPOINT)
			bpf_tail_call(ctx, &tail_tracepoint, 0);
		else
			bpf_tail_call(ctx, &tail_perf_event, 0);
	}
	finish(s, w.hash);
	if (wall_mode)
		wall_sampled(tid, s->hdr.hash);
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
	if (wall_mode)
		wall_sampled(s->hdr.tid, s->hdr.hash);
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
	return on_event(ctx, 0, EVENT_SAMPLE, 0);
}

/* Attached to each traced tracepoint with its 1-based index as the BPF cookie. */
SEC("tracepoint")
int on_tracepoint(void *ctx)
{
	return on_event(ctx, (__u32)bpf_get_attach_cookie(ctx), EVENT_TRACEPOINT, 0);
}

/* Argument `i` (from 0) of the function a uprobe sits at the start of.
 * All four are read at fixed offsets first: the verifier refuses a context
 * read at an offset computed from `i`, which clang makes of a switch. */
static __always_inline __u64 call_arg(struct pt_regs *regs, __u32 i)
{
	__u64 a0 = PT_REGS_PARM1(regs), a1 = PT_REGS_PARM2(regs), a2 = PT_REGS_PARM3(regs),
	      a3 = PT_REGS_PARM4(regs);

	asm volatile("" : "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3));
	return i == 0 ? a0 : i == 1 ? a1 : i == 2 ? a2 : a3;
}

/* alloc: attached to each of the VM's allocation functions (their entry,
 * after any endbr64), with a cookie saying where the class and the flags
 * are (RPROF_ALLOC_*). Every call traps whatever is kept: 1 in
 * alloc_every is walked and weighs alloc_every. */
static __always_inline int alloc_event(struct pt_regs *ctx)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	enum rprof_alloc_cookie flags_arg =
	    (cookie >> RPROF_ALLOC_FLAGS_SHIFT) & RPROF_ALLOC_ARG_MASK;
	struct allocation a = {
	    .klass = call_arg(ctx, cookie & RPROF_ALLOC_ARG_MASK),
	    .type = (cookie >> RPROF_ALLOC_TYPE_SHIFT) & RPROF_ALLOC_TYPE_MASK,
	};

	if (alloc_every > 1 && bpf_get_prandom_u32() % alloc_every)
		return 0;
	if (flags_arg != RPROF_ALLOC_NO_ARG)
		a.type = call_arg(ctx, flags_arg) & RPROF_ALLOC_TYPE_MASK;
	/* An imemo's class slot holds data of its own (3.4 passes it there). */
	if (a.type == T_IMEMO)
		a.klass = 0;
	return on_event(ctx, 1, EVENT_ALLOC, &a);
}

/* alloc, where the kernel has uprobe.multi links (6.6+, and filtering by
 * process): one link per process and file, closed with one grace period
 * (a perf-event uprobe waits for one each, six per Ruby). */
SEC("uprobe.multi")
int on_alloc_multi(struct pt_regs *ctx)
{
	return alloc_event(ctx);
}

/* alloc, elsewhere: a perf-event uprobe per function. */
SEC("uprobe")
int on_alloc(struct pt_regs *ctx)
{
	return alloc_event(ctx);
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
	mark_pid(ctgid);
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

	__u64 start = start_ticks(task->group_leader);

	if (!f || f->start_ticks != start) {
		struct rprof_followed now = {.start_ticks = start};

		if (!follow_every_exec)
			return 0;
		mark_pid(tgid);
		if (bpf_map_update_elem(&followed, &tgid, &now, BPF_ANY))
			return 0;
	}
	bpf_map_delete_elem(&procs, &tgid);
	process_event(RPROF_PROCESS_EXEC, tgid, start, 0, 0, 0, 0);
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

/* wall: the recipe of `task`'s process, if it is the process rprof profiles
 * (not another on a reused PID), and the task is not exiting: a task seen
 * after its exit was counted would count its whole life again. */
static __always_inline struct rprof_proc *recipe_of(struct task_struct *task)
{
	__u32 tgid = task->tgid;
	struct rprof_proc *p = bpf_map_lookup_elem(&procs, &tgid);

	if (task->flags & PF_EXITING)
		return 0;
	return p && started_as(task->group_leader, p) ? p : 0;
}

/* wall: the rb_thread_t of `task`, the current task, as a walk would find
 * it (its EC's thread); 0 if it runs no Ruby or the EC is another's. */
static __always_inline __u64 thread_of(struct rprof_proc *p, struct task_struct *task)
{
	__u64 tp = task->thread.fsbase, ec = 0, th = 0;

	if (read_ec(p, task->tgid, tp, &ec) || !ec)
		return 0;
	if (bpf_probe_read_user(&th, sizeof(th), (void *)(ec + p->ec_thread_ptr)))
		return 0;
	if (p->verify_thread && !ec_is_this_thread(p, th, tp))
		return 0;
	return th;
}

/* wall --kernel: the kernel stack of the thread leaving the CPU, taken in
 * the switch program (the walk's function cannot take the task) for the
 * walk to add after the Ruby frames. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rprof_kernel_stack);
} wall_kstacks SEC(".maps");

/* wall --kernel: `task`'s kernel stack into `k` (leaf first; none if it
 * cannot be taken). Of a task leaving the CPU or blocked, it begins at the
 * function that called the scheduler. */
static __always_inline void take_kernel_stack(struct rprof_kernel_stack *k,
					      struct task_struct *task)
{
	long got = bpf_get_task_stack(task, k->ips, sizeof(k->ips), 0);

	k->n = got > 0 ? got / sizeof(__u64) : 0;
}

/* wall --kernel: the kernel frames taken for this switch, at `off` in the
 * record's body, mixed into `hash`. */
static __always_inline __u64 wall_kernel_frames(struct scratch *s, __u64 off, __u64 hash)
{
	__u32 zero = 0, n;
	struct rprof_kernel_stack *k = bpf_map_lookup_elem(&wall_kstacks, &zero);
	__u64 len;

	if (!k || !k->n)
		return hash;
	n = k->n < RPROF_MAX_KERNEL ? k->n : RPROF_MAX_KERNEL;
	/* At most 1,016 bytes: a mask the verifier can bound (CLAMPED wants a
	 * power of two, and KERNEL_BYTES is not one). */
	len = (__u64)n * sizeof(__u64);
	asm volatile("" : "+r"(len));
	if (bpf_probe_read_kernel(s->body + off, len & 1023, k->ips))
		return hash;
	for (__u32 i = 0; i < RPROF_MAX_KERNEL && i < n; i++)
		hash = mix(hash, k->ips[i]);
	s->hdr.nkernel = n;
	return hash;
}

/* wall --native/--kernel: the stacks beyond Ruby's of the thread leaving
 * the CPU (the current task), for the record in this CPU's tracepoint
 * slot; a function of its own, which the verifier checks apart from the
 * walk. Returns the record's hash with them. It repeats other_stacks's
 * native part, and other_stacks keeps its own offsets: the CPU sample's
 * native program is sensitive to their shape (RPROF_DEBUG=stats: 145,000
 * instructions with --native, 151,000 with --kernel too). Rewritten around
 * body_after, even its kernel part alone, it went past the verifier's
 * million with --native alone; with the native part in a shared helper,
 * 441,000 with both. */
__noinline __u64 wall_other_stacks(__u32 tgid)
{
	__u32 slot = bpf_get_smp_processor_id() * 2 + 1;
	struct scratch *s = bpf_map_lookup_elem(&scratch, &slot);
	struct rprof_proc *p = bpf_map_lookup_elem(&procs, &tgid);
	struct unwind_ctx u = {};
	__u32 nnative = 0, stat;
	__u64 hash, off;

	if (!s)
		return 0;
	hash = s->ruby_hash;
	if (!p)
		return hash;
	if (native_stacks && body_after(s, 0, RUBY_BYTES, &off)) {
		nnative = unwind_native(&u, (struct rprof_native_frame *)(s->body + off),
					p->native_space);
		hash = mix(mix(hash, u.hash), u.stop);
		stat = RPROF_STAT_NATIVE_STOP + (u.stop < RPROF_NATIVE_STOP_MAX ? u.stop : 0);
		stat_inc(stat);
		s->hdr.nnative = nnative;
		s->hdr.native_stop = u.stop;
	}
	if (kernel_stacks && body_after(s, nnative, RUBY_BYTES + NATIVE_BYTES, &off))
		hash = wall_kernel_frames(s, off, hash);
	return hash;
}

/* The walk and the counting, in a global function: the verifier checks it
 * once, apart from its callers (a switch program with one walk inlined took
 * 1.6 s to verify, and with two did not fit in a million instructions).
 * Its record goes with weight 0: the wait is counted when it ends. Returns
 * the stack's hash, 0 if it could not be counted. */
__noinline __u64 wall_walk_count(struct wall_walk *r)
{
	__u32 tgid, slot = bpf_get_smp_processor_id() * 2 + 1;
	struct task_struct *task;
	struct walk_ctx w = {};
	struct rprof_proc *p;
	struct scratch *s;

	if (!r || !r->tgid)
		return 0;
	tgid = r->tgid;
	task = (void *)r->task;
	/* The tracepoint slot: nothing else runs on this CPU while it switches. */
	s = bpf_map_lookup_elem(&scratch, &slot);
	p = bpf_map_lookup_elem(&procs, &tgid);
	if (!s || !p)
		return 0;
	w.s = s;
	w.p = p;
	begin(s, p, tgid, r->tid, 0);
	bpf_probe_read_kernel_str(s->hdr.comm, sizeof(s->hdr.comm), task->comm);
	read_stack(&w, BPF_CORE_READ(task, thread.fsbase), tgid);
	s->hdr.wall_state = r->state;
	s->hdr.wall_syscall = r->syscall;
	s->hdr.wall_object = r->object;
	s->hdr.peer_family = r->peer_family;
	s->hdr.peer_port = r->peer_port;
	s->hdr.local_port = r->local_port;
	__builtin_memcpy(s->hdr.peer_addr, r->peer_addr, sizeof(s->hdr.peer_addr));
	s->hdr.weight = 0;
	s->ruby_hash = w.hash;
	finish(s, native_stacks || kernel_stacks ? wall_other_stacks(tgid) : w.hash);
	return s->hdr.hash;
}

/* wall: asks for `task`'s stack to be walked, for the wait `e` opens, and
 * for what its system call waits on (not Ruby's own waits: a sleep's poll
 * of Ruby's timer pipe is no pipe the program reads). */
static __always_inline void want_walk(struct wall_walk *r, struct task_struct *task,
				      struct rprof_wall_task *e)
{
	r->task = (__u64)task;
	r->tgid = task->tgid;
	r->tid = task->pid;
	r->state = e->state;
	r->syscall = e->syscall;
	if (e->syscall >= 0 && (e->state == RPROF_WALL_BLOCKED || e->state == RPROF_WALL_GVL_HELD ||
				e->state == RPROF_WALL_OFF_CPU))
		r->object = object_of(task, e->syscall, r);
}

/* wall: how far the GC's clock ran in a GVL wait, from its opening to the
 * thread's wakeup: while a thread waits for the GVL, only the GVL's holder
 * can collect. (Capped at the wait by the caller: the clock is the
 * process's CPU time, and counts all of a collection step that began before
 * the wait.) */
static __always_inline __u64 gc_waited(struct rprof_wall_task *e)
{
	__u64 at = e->gc_at, woke = e->gc_woke;

	e->gc_at = 0;
	e->gc_woke = 0;
	return at && woke > at ? woke - at : 0;
}

/* wall: `ns` of a wait of `state` to its stack `hash` if it was walked, else
 * pending in the thread's slot of its kind (for userspace to share among the
 * walked stacks of that kind); a wait opened by the sweep whose stack
 * userspace has not read yet (state 0) has neither. */
static __always_inline void charge_wait(struct rprof_wall_task *e, __u64 hash, __u32 state,
					__s32 syscall, __u64 ns)
{
	struct rprof_wall_slot *sl = state ? slot_of(e, RPROF_WALL_KEY(state, syscall)) : 0;

	if (hash) {
		if (sl)
			sl->hash = hash;
		add_time(hash, ns);
	} else if (state) {
		unpend(sl, ns);
	} else {
		stat_add(RPROF_STAT_WALL_UNSEEN, ns);
	}
}

/* wall: a GVL wait of `ns`, `gc` of it while the GVL's holder collected: to
 * its stack and that stack's GC twin (hash ^ RPROF_WALL_GC_SALT). */
static __always_inline void charge_gvl_wait(struct rprof_wall_task *e, __u64 hash, __s32 syscall,
					    __u64 ns, __u64 gc)
{
	gc = gc < ns ? gc : ns;
	charge_wait(e, hash, RPROF_WALL_GVL, syscall, ns - gc);
	if (gc)
		charge_wait(e, hash ? hash ^ RPROF_WALL_GC_SALT : 0, RPROF_WALL_GC, syscall, gc);
}

/* wall: a GVL wait of `ns` that ended at `end`, in which the GC's clock
 * ran `gc`: that much of it (at most all) is counted as waiting for GC now,
 * and the rest held until the thread's next GVL wait ends (release_held).
 * Ruby's clock counts a collection step when the step ends: a wait that
 * ended inside a step (Ruby 3.1's waiter that keeps time wakes itself every
 * 100 ms, GVL or not) saw none of it, and the wait after it, which sees the
 * whole step, is too short to take it. */
static __always_inline void hold_gvl_wait(struct rprof_wall_task *e, __u64 hash, __s32 syscall,
					  __u64 ns, __u64 gc, __u64 end)
{
	gc = gc < ns ? gc : ns;
	if (gc)
		charge_wait(e, hash ? hash ^ RPROF_WALL_GC_SALT : 0, RPROF_WALL_GC, syscall, gc);
	if (gc == ns)
		return;
	e->held_hash = hash;
	e->held_syscall = syscall;
	e->held_end = end;
	__sync_lock_test_and_set(&e->held_ns, ns - gc);
}

/* wall: the held part of the last GVL wait (hold_gvl_wait), now that the
 * next one, which began at `next`, ended, having seen the clock run `over`
 * longer than it lasted: a step ended in it that began before it, in the
 * held wait or in between (the thread then on a CPU or ready, not waiting
 * for the GVL). 0: all of it waited for the GVL. */
static __always_inline void release_held(struct rprof_wall_task *e, __u64 over, __u64 next)
{
	__u64 ns = __sync_lock_test_and_set(&e->held_ns, 0);
	__u64 between = next > e->held_end ? next - e->held_end : 0;

	if (ns)
		charge_gvl_wait(e, e->held_hash, e->held_syscall, ns,
				over > between ? over - between : 0);
}

/* wall: how far the GC's clock ran from a GVL wait's opening (`at`) to
 * `clock`, less the CPU time `ran` the thread used after the wait (a
 * collection it made itself, had it taken the GVL, took at most that): the
 * GC part of a wait whose end no thread of its process reported. */
static __always_inline __u64 gc_since(__u64 at, __u64 clock, __u64 ran)
{
	return clock > at + ran ? clock - at - ran : 0;
}

/* wall: the GC part of `e`'s owed wait: gc_since by `clock`, read when the
 * thread's CPU time was `exec`, or, if that says more, by the clock read at
 * its first CPU sample after the wait (note_owed_clock). */
static __always_inline __u64 owed_gc(struct rprof_wall_task *e, __u64 clock, __u64 exec)
{
	__u64 early = e->owed_clock ? gc_since(e->owed_gc_at, e->owed_clock, e->owed_ran) : 0;
	__u64 late = gc_since(e->owed_gc_at, clock, exec - e->owed_exec);

	return late > early ? late : early;
}

/* wall: a GVL wait of `ns` from `start`, `gc` of it while the GVL's holder
 * collected, ends: the part held from the GVL wait before it is released
 * (release_held: whatever of `gc` the wait cannot hold went there), and
 * this one's part not shown to be GC is held in turn (`hold`), or, with no
 * wait after it to end, counted now. */
static __always_inline void end_gvl_wait(struct rprof_wall_task *e, __u64 hash, __s32 syscall,
					 __u64 start, __u64 ns, __u64 gc, bool hold)
{
	release_held(e, gc > ns ? gc - ns : 0, start);
	if (hold)
		hold_gvl_wait(e, hash, syscall, ns, gc, start + ns);
	else
		charge_gvl_wait(e, hash, syscall, ns, gc);
}

/* wall: a GVL wait of `ns` from `start` whose end rprof did not see
 * (missed_switch_in), split as at a switch-in: by the clock its waker read
 * (gc_woke), or, woken from outside the process, by the clock now less the
 * CPU time `ran` the thread has used since (gc_since). Before, all of
 * it counted as waiting for the GVL, its GC part too: a time slice's
 * collections (38 ms of gc_waits's 3.3 burst). */
static __always_inline void missed_gvl_wait(struct rprof_proc *p, struct rprof_wall_task *e,
					    __u64 hash, __u64 start, __u64 ns, __u64 ran)
{
	__u64 gc;

	if (e->gc_woke) {
		gc = gc_waited(e);
	} else {
		gc = gc_since(e->gc_at, gc_clock_at(p), ran);
		e->gc_at = 0;
	}
	end_gvl_wait(e, hash, e->syscall, start, ns, gc, true);
}

/* wall: a GVL wait that a thread of another process (an interrupt: Ruby
 * 3.1's waiter that keeps time wakes itself every 100 ms) ended is split
 * as the thread switches out again (not preempted: then at the switch-out
 * after), from its own memory, if it waits for the GVL again: gc_since at
 * that switch-out or, if larger, at the thread's first CPU sample after the
 * wait (note_owed_clock). Otherwise all of it waited for the GVL. */
static __always_inline void settle_owed(struct rprof_proc *p, struct rprof_wall_task *e,
					struct task_struct *task, __u32 state)
{
	__u64 ns = e->owed_ns, gc;

	e->owed_ns = 0;
	if (state != RPROF_WALL_GVL || !e->owed_gc_at) {
		e->owed_clock = 0;
		release_held(e, 0, 0);
		charge_gvl_wait(e, e->owed_hash, e->owed_syscall, ns, 0);
		return;
	}
	gc = owed_gc(e, gc_clock_at(p), task->se.sum_exec_runtime);
	e->owed_clock = 0;
	end_gvl_wait(e, e->owed_hash, e->owed_syscall, e->owed_end - ns, ns, gc, true);
}

/* wall: whether this switch-out of `e`'s thread walks its stack. Always,
 * for a thread that switched out fewer than RPROF_WALL_WALKS_PER_S times a
 * second in its last window (a server thread); else by chance, the same for
 * every switch-out of the window, whatever its stack (only its own
 * switch-outs touch these fields). Preemptions (`preempted`) are counted
 * apart: a CPU-bound thread that other programs preempt 2,200 times a
 * second (seen beside a test suite) still walks every wait it blocks in. */
static __always_inline bool may_walk(struct rprof_wall_task *e, __u64 now, bool preempted)
{
	__u32 i = preempted ? 1 : 0;
	__u64 span = now - e->window_at[i], chance;

	e->window_outs[i]++;
	if (now > e->window_at[i] && span >= RPROF_WALL_WINDOW_NS) {
		/* walks wanted in the window / switch-outs it had, in 1/65536ths */
		chance = RPROF_WALL_WALKS_PER_S * RPROF_WALL_ALWAYS * (span / 1000000) /
			 (1000ULL * e->window_outs[i]);
		e->walk_chance[i] = chance >= RPROF_WALL_ALWAYS ? 0 : (chance ? chance : 1);
		e->window_at[i] = now;
		e->window_outs[i] = 0;
	}
	return !e->walk_chance[i] ||
	       (bpf_get_prandom_u32() & (RPROF_WALL_ALWAYS - 1)) < e->walk_chance[i];
}

/* wall: `prev` leaves the CPU (this runs in its context, so its memory is
 * the current one). Its time on CPU since its last mark waits in its
 * running slot for its next CPU sample; the wait that begins is opened with
 * the reason its rb_thread_t gives, and its stack walked now (`walk` asks
 * for it; the caller gives the hash to the wait) unless the thread switches
 * too often to walk every wait (may_walk).
 * The wait is counted when the thread switches in again, or when userspace
 * sweeps. Returns the thread's interval. */
static __always_inline struct rprof_wall_task *wall_out(struct task_struct *prev, bool runnable,
							__u64 now, struct wall_walk *walk)
{
	__u32 tid = prev->pid, slot, state;
	struct rprof_wall_task *e;
	struct rprof_proc *p;
	struct scratch *s;
	__u64 mark, since, ran;
	__s32 syscall;

	p = recipe_of(prev);
	if (!p)
		return 0;
	e = bpf_map_lookup_elem(&wall_tasks, &tid);
	if (!e) {
		since = prev->start_time > p->wall_since ? prev->start_time : p->wall_since;
		add_wall_task(tid, FRESH_SWITCH, (since << 1) | ON_CPU, now, 0);
		e = bpf_map_lookup_elem(&wall_tasks, &tid);
		if (!e)
			return 0;
	}
	slot = bpf_get_smp_processor_id() * 2 + 1;
	s = bpf_map_lookup_elem(&scratch, &slot);
	if (!s)
		return 0;
	stat_inc(RPROF_STAT_EVENTS);
	/* Preempted: whatever orig_ax holds (an interrupt's vector), the
	 * thread waits for a CPU, not in a system call. */
	syscall = runnable ? -1 : syscall_of(prev);
	state = runnable ? RPROF_WALL_RUNNABLE : wall_reason(p, s, thread_of(p, prev));
	/* On CPU from here until the wait below is published: the sweep
	 * leaves marks on CPU alone. */
	mark = __sync_lock_test_and_set(&e->mark, (now << 1) | ON_CPU);
	since = mark >> 1;
	ran = !(mark & ON_CPU) ? missed_switch_in(p, e, tid, prev, mark, now)
	      : since < now    ? now - since
			       : 0;
	/* Running time is shared among the stacks the thread's CPU samples find
	 * (wall_sample_weight): the stack a thread leaves the CPU in is where it
	 * blocks, not where it ran. */
	unpend(slot_of(e, RPROF_WALL_KEY(RPROF_WALL_RUNNING, -1)), ran);
	if (e->owed_ns && state != RPROF_WALL_RUNNABLE)
		settle_owed(p, e, prev, state);
	else if (!e->owed_ns && state != RPROF_WALL_GVL && state != RPROF_WALL_RUNNABLE)
		release_held(e, 0, 0);
	e->hash = 0;
	e->state = state;
	e->syscall = syscall;
	e->exec = prev->se.sum_exec_runtime;
	e->gc_woke = 0;
	e->gc_at = state == RPROF_WALL_GVL ? gc_clock_at(p) : 0;
	if (e->gc_at) {
		__u32 *waiter = tid_slot(&gvl_waiters, tid);

		if (waiter)
			*waiter = tid;
	}
	if (may_walk(e, now, runnable))
		want_walk(walk, prev, e);
	return e; /* on CPU still: the caller opens the wait (open_wait) */
}

/* wall: `e`'s wait opens at `at`, after its stack was walked (if it was),
 * and after its other fields: the sweep reads the mark, then them. The
 * walk's own time, from `now`, is held until the wait ends (walk_part), for
 * the thread that woke it says whose time it was. */
static __always_inline void open_wait(struct rprof_wall_task *e, __u32 tid, __u64 now, __u64 at,
				      __u32 next)
{
	__u32 *walker = at > now ? tid_slot(&walk_waiters, tid) : 0;

	e->walk_ns = at > now ? at - now : 0;
	e->walk_next = next;
	e->walk_by_next = 0;
	if (walker)
		*walker = tid;
	__sync_lock_test_and_set(&e->mark, at << 1);
}

/* wall: `next` takes the CPU: its wait ends. Its time goes to the wait's
 * stack if known (walked at switch-out, or given by userspace), else to the
 * slot of its kind, for userspace to share among the walked stacks of that
 * kind. */
static __always_inline void wall_in(struct task_struct *next, __u64 now)
{
	__u32 tid = next->pid;
	struct rprof_wall_task *e;
	struct rprof_proc *p;
	__u64 old, ns, gc, walk, start;

	p = recipe_of(next);
	if (!p)
		return;
	e = bpf_map_lookup_elem(&wall_tasks, &tid);
	if (!e) {
		/* Off CPU since before rprof saw it (userspace seeds the threads
		 * it finds blocked; this one woke first): that time has no stack. */
		if (next->start_time < p->wall_since && p->wall_since < now)
			stat_add(RPROF_STAT_WALL_UNSEEN, now - p->wall_since);
		add_wall_task(tid, FRESH_SWITCH, (now << 1) | ON_CPU, now, 0);
		return;
	}
	if (READ_MARK(e) & ON_CPU)
		return;
	old = __sync_lock_test_and_set(&e->mark, (now << 1) | ON_CPU);
	if ((old & ON_CPU) || (old >> 1) >= now)
		return;
	walk = walk_part(e);
	start = (old >> 1) - walk;
	ns = now - start;
	if (e->gc_at && e->state == RPROF_WALL_GVL && !e->gc_woke) {
		/* Woken from outside its process: split as it switches out. */
		e->owed_clock = 0;
		e->owed_ns = ns;
		e->owed_hash = e->hash;
		e->owed_syscall = e->syscall;
		e->owed_exec = next->se.sum_exec_runtime;
		e->owed_end = now;
		e->owed_gc_at = e->gc_at;
		return;
	}
	if (e->state == RPROF_WALL_GVL && e->gc_at) {
		gc = gc_waited(e);
		end_gvl_wait(e, e->hash, e->syscall, start, ns, gc, true);
	} else {
		/* (a GVL wait without a GC clock has no GC part) */
		charge_wait(e, e->hash, e->state, e->syscall, ns);
	}
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	struct wall_walk walk = {};
	struct rprof_wall_task *out;
	__u64 now;

	/* Most switches on a machine are other processes': not even the clock
	 * is read for them. */
	if (stop_ns || !(may_follow(prev->tgid) | may_follow(next->tgid)))
		return 0;
	now = bpf_ktime_get_ns();
	/* Preempted (or yielding), the thread stays ready to run. */
	out = wall_out(prev, preempt || prev_state == 0, now, &walk);
	if (kernel_stacks && out && walk.tgid) {
		__u32 zero = 0;
		struct rprof_kernel_stack *k = bpf_map_lookup_elem(&wall_kstacks, &zero);

		if (k)
			take_kernel_stack(k, prev);
	}
	if (out && walk.tgid) {
		out->hash = wall_walk_count(&walk);
		open_wait(out, prev->pid, now, bpf_ktime_get_ns(), next->pid);
	} else if (out) {
		open_wait(out, prev->pid, now, now, 0);
	}
	wall_in(next, now);
	return 0;
}

/* wall: a thread of a followed process wakes another of its threads, which
 * waits for the GVL (the holder releasing it, or Ruby's timer thread): the
 * GC's clock as that wait ends, read here because this runs in the waker,
 * whose memory is the process's (at the switch-in, the CPU may still be in
 * another process's). sched_waking, not sched_wakeup: the latter may run on
 * the wakee's CPU, in whatever task is there. And whether the waker of a
 * wait whose stack was walked is the thread its switch-out handed the CPU
 * to (walk_part). */
SEC("tp_btf/sched_waking")
int BPF_PROG(on_waking, struct task_struct *task)
{
	__u32 tid = task->pid, *waiter = tid_slot(&gvl_waiters, tid),
	      *walker = tid_slot(&walk_waiters, tid);
	__u64 waker = bpf_get_current_pid_tgid();
	bool gvl, walked;
	struct rprof_wall_task *e;
	struct rprof_proc *p;

	if (stop_ns)
		return 0;
	gvl = waiter && *waiter == tid && task->tgid == (__u32)(waker >> 32);
	walked = walker && *walker == tid;
	if (!gvl && !walked)
		return 0;
	e = bpf_map_lookup_elem(&wall_tasks, &tid);
	if (!e)
		return 0;
	if (walked && e->walk_ns && e->walk_next == (__u32)waker)
		e->walk_by_next = 1;
	if (!gvl || !e->gc_at || e->gc_woke)
		return 0;
	p = recipe_of(task);
	if (p)
		e->gc_woke = gc_clock_at(p);
	return 0;
}

/* wall --kernel: the kernel stack of each blocked thread whose stack
 * userspace is to read (by thread id; userspace deletes what it took). The
 * thread cannot leave its wait before userspace reads: if it does, the seed
 * is refused (its mark changed) and the stack unused. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct rprof_kernel_stack);
} wall_seed_kstacks SEC(".maps");

/* The sweep's own buffer (a switch on this CPU may preempt it and use
 * wall_kstacks). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rprof_kernel_stack);
} wall_sweep_kstack SEC(".maps");

/* wall --kernel: `task`'s kernel stack, for userspace to add to the stack it
 * reads (a blocked task: the stack of the call it blocks in). */
static __always_inline void seed_kernel_stack(struct task_struct *task, __u32 tid)
{
	__u32 zero = 0;
	struct rprof_kernel_stack *k = bpf_map_lookup_elem(&wall_sweep_kstack, &zero);

	if (!kernel_stacks || !k)
		return;
	take_kernel_stack(k, task);
	bpf_map_update_elem(&wall_seed_kstacks, &tid, k, BPF_ANY);
}

/* wall: each slot's pending time taken, for userspace to share among the
 * walked stacks of its kind, and its last stack listed, to keep named. */
static __always_inline void sweep_slots(struct rprof_wall_task *e, struct rprof_wall_thread *out)
{
	int i;

	for (i = 0; i < RPROF_WALL_SLOTS; i++) {
		struct rprof_wall_slot *sl = &e->slots[i];
		__u64 taken;

		if (!sl->key)
			break;
		taken = __sync_lock_test_and_set(&sl->pending, 0);
		out->slots[i].key = sl->key;
		out->slots[i].hash = sl->hash;
		out->slots[i].pending = taken;
	}
}

/* The sweep's record of a thread (too big for its stack beside a new
 * thread's interval). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rprof_wall_thread);
} wall_sweep_out SEC(".maps");

/* wall: each followed process's GC clock (as gc_clock_at reads it) when
 * the recording stopped, read by userspace (key: PID), for the last sweep,
 * which runs in rprof and cannot read it: what splits the GVL waits not
 * split by then. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u64);
} wall_stop_clocks SEC(".maps");

/* wall: the GC clock of `task`'s process at the recording's stop, for the
 * last sweep; 0 before it, or if it could not be read. */
static __always_inline __u64 stop_clock(struct task_struct *task)
{
	__u32 tgid = task->tgid;
	__u64 *clock = wall_final ? bpf_map_lookup_elem(&wall_stop_clocks, &tgid) : 0;

	return clock ? *clock : 0;
}

/* wall: a GVL wait not split when recording ends (or its thread does), as
 * settle_owed would, by the GC clock at the stop (`clock`; 0: none) or the
 * one read at the thread's first CPU sample after the wait, whichever says
 * more; with neither, all of it waited for the GVL. Nothing is held any
 * more: no wait after it will end. */
static __always_inline void settle_owed_final(struct rprof_wall_task *e, struct task_struct *task,
					      __u64 clock)
{
	__u64 ns = __sync_lock_test_and_set(&e->owed_ns, 0), gc = 0;

	if (ns && e->owed_gc_at)
		gc = owed_gc(e, clock, task->se.sum_exec_runtime);
	e->owed_clock = 0;
	if (ns)
		end_gvl_wait(e, e->owed_hash, e->owed_syscall, e->owed_end - ns, ns, gc, false);
	release_held(e, 0, 0);
}

/* wall: a GVL wait open when the recording stopped, from `start`, `ns`
 * long: split by the clock its waker read, if a thread of its process woke
 * it, else by the clock at the stop (`clock`), as a switch-in would have
 * split it. Before, all of it counted as waiting for the GVL: up to a time
 * slice of each waiting thread, at the end of every recording. */
static __always_inline void final_gvl_wait(struct rprof_wall_task *e, __u64 hash, __u64 start,
					   __u64 ns, __u64 clock)
{
	__u64 gc = e->gc_woke ? gc_waited(e) : gc_since(e->gc_at, clock, 0);

	e->gc_at = 0;
	end_gvl_wait(e, hash, e->syscall, start, ns, gc, false);
}

/* wall: `ns` of an open wait the sweep counts: to its stack, or (a wait
 * the recording's stop found after its thread ran, whose stack cannot be
 * read any more) pending in the slot of its kind. */
static __always_inline void sweep_wait(struct rprof_wall_task *e, __u64 hash, __u64 ns)
{
	if (hash)
		add_time(hash, ns);
	else if (e->state)
		unpend(slot_of(e, RPROF_WALL_KEY(e->state, e->syscall)), ns);
	else
		stat_add(RPROF_STAT_WALL_UNSEEN, ns);
}

/* wall, once an epoch and at the end: every followed thread, for userspace
 * (which reads the stacks of waits that have none); the time of each wait
 * with a stack is counted up to now, so long waits show in every epoch. */
SEC("iter/task")
int wall_sweep(struct bpf_iter__task *ctx)
{
	struct task_struct *task = ctx->task;
	struct rprof_wall_thread *out;
	__u32 zero = 0;
	struct rprof_wall_task *e;
	struct rprof_proc *p;
	__u64 now, mark, hash, walk;
	__u32 tid;
	bool running, unmoved;

	if (!task)
		return 0;
	tid = task->pid;
	p = recipe_of(task);
	out = bpf_map_lookup_elem(&wall_sweep_out, &zero);
	if (!p || !out)
		return 0;
	__builtin_memset(out, 0, sizeof(*out));
	out->pid = task->tgid;
	out->tid = tid;
	out->start_ticks = p->start_ticks;
	out->tp = BPF_CORE_READ(task, thread.fsbase);
	out->syscall = syscall_of(task);
	e = bpf_map_lookup_elem(&wall_tasks, &tid);
	if (!e) {
		/* Never seen switching since it was followed: on CPU (or ready)
		 * all along, or blocked all along, since it was followed or
		 * since it began (a new thread not yet run: counted from the
		 * recording's start, a Puma worker forked 2 s into it had a
		 * thread of 4 s). A blocked one's wait is opened now, before
		 * userspace reads its stack, so that a wakeup meanwhile ends it
		 * (and userspace sees the mark change). */
		running = task->on_cpu || task->__state == 0;
		mark = task->start_time > p->wall_since ? task->start_time : p->wall_since;
		mark = (mark << 1) | (running ? ON_CPU : 0);
		if (add_wall_task(tid, FRESH_SWEEP, mark, 0, task->se.sum_exec_runtime)) {
			out->needs_stack = !running;
			out->seed_mark = mark;
		}
	} else {
		now = bpf_ktime_get_ns();
		now = stop_ns && stop_ns < now ? stop_ns : now;
		mark = READ_MARK(e);
		out->seen = 1;
		unmoved = task->se.sum_exec_runtime == e->exec;
		/* Not if it has run since (a switch-in rprof did not see): its
		 * own next event splits that interval. Once the recording has
		 * stopped, no event is counted: a wait open then lasted until
		 * the stop, and its stack is read only if it has not run since. */
		if (!(mark & ON_CPU) && (unmoved || stop_ns)) {
			hash = seeded_hash(e, tid, mark);
			if (!hash && unmoved) {
				out->needs_stack = 1;
				out->seed_mark = mark;
				out->state = e->state;
				out->wait_syscall = e->syscall;
			} else if (e->gc_at && !wall_final) {
				/* A GVL wait the GC clock splits is counted at its
				 * end, once the clock is read (by the thread that
				 * wakes it: the sweep runs in rprof), or by the last
				 * sweep, split by the clock userspace read at the
				 * stop (final_gvl_wait). */
			} else if ((mark >> 1) < now &&
				   __sync_val_compare_and_swap(&e->mark, mark, now << 1) == mark) {
				walk = walk_part(e);
				if (e->gc_at && e->state == RPROF_WALL_GVL)
					final_gvl_wait(e, hash, (mark >> 1) - walk,
						       now - (mark >> 1) + walk, stop_clock(task));
				else
					sweep_wait(e, hash, now - (mark >> 1) + walk);
			}
		}
		out->held_hash = e->held_ns ? e->held_hash : 0;
		out->owed_hash = e->owed_ns ? e->owed_hash : 0;
		if ((e->owed_ns || e->held_ns) && wall_final)
			settle_owed_final(e, task, stop_clock(task));
		out->hash = e->hash;
		sweep_slots(e, out);
	}
	if (out->needs_stack)
		seed_kernel_stack(task, tid);
	bpf_seq_write(ctx->meta->seq, out, sizeof(*out));
	return 0;
}

/* wall: a thread that ends has no interval any more; its pending time is
 * counted to its slots' stacks (or as unseen, for a slot never walked). */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_thread_exit, struct task_struct *task)
{
	__u32 tid = task->pid;
	struct rprof_wall_task *e = bpf_map_lookup_elem(&wall_tasks, &tid);
	int i;

	if (e)
		settle_owed_final(e, task, 0);
	for (i = 0; e && i < RPROF_WALL_SLOTS; i++) {
		struct rprof_wall_slot *sl = &e->slots[i];
		__u64 taken = __sync_lock_test_and_set(&sl->pending, 0);

		if (taken && sl->hash)
			add_time(sl->hash, taken);
		else if (taken)
			stat_add(RPROF_STAT_WALL_UNSEEN, taken);
	}
	bpf_map_delete_elem(&wall_tasks, &tid);
	bpf_map_delete_elem(&wall_seeds, &tid);
	return 0;
}
