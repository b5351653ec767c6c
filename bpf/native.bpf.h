/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * --native: unwinds the user-space native stack of the thread that hit the
 * event, in BPF, from the registers the thread entered the kernel with. Each
 * frame's rule comes from the compact tables userspace built from the ELF
 * files' .eh_frame (src/unwind/), shared by every process that maps a file;
 * code without CFI (JIT code, files built with frame pointers) is followed
 * through rbp. Only addresses leave the kernel: userspace names them.
 *
 * Included by rprof.bpf.c; x86-64 only.
 */
#ifndef RPROF_NATIVE_BPF_H
#define RPROF_NATIVE_BPF_H

/* Steps of a binary search over 2^24 rows or RPROF_MAX_MAPPINGS mappings. */
#define ROW_SEARCH_STEPS     25
#define MAPPING_SEARCH_STEPS 10
/* A frame pointer further than this above the stack pointer is not one. */
#define MAX_FRAME_BYTES (8 << 20)
/* Where a signal frame's registers are: its ucontext's mcontext (struct
 * sigcontext) starts 40 bytes into the ucontext the trampoline's rsp points to. */
#define SIGFRAME_MCONTEXT 40
#define SIGCONTEXT_RBP	  80
#define SIGCONTEXT_RSP	  120
#define SIGCONTEXT_RIP	  128

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* sized by userspace with --native */
	__type(key, __u32);
	__type(value, struct rprof_unwind_row);
} unwind_rows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* sized by userspace with --native */
	__type(key, __u32);
	__type(value, struct rprof_unwind_rule);
} unwind_rules SEC(".maps");

/* Per file and page of its code: the row covering the page's start. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* sized by userspace with --native */
	__type(key, __u32);
	__type(value, __u32);
} unwind_pages SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* sized by userspace with --native */
	__type(key, __u32);
	__type(value, struct rprof_unwind_file);
} unwind_files SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* sized by userspace with --native */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct rprof_space);
} spaces SEC(".maps");

/* The state of one unwinding, carried from frame to frame by bpf_loop. */
struct unwind_ctx {
	struct rprof_native_frame *out; /* RPROF_MAX_NATIVE slots */
	struct rprof_space *space;
	struct rprof_mapping *last; /* of the frame before: callers are often in the same file */
	__u64 regs[16];		    /* the leaf frame's registers, by DWARF number */
	__u64 pc;
	__u64 sp;
	__u64 bp;
	__u64 hash; /* of every frame recorded */
	__u32 n;
	__u32 stop;
	bool bp_known;
	bool exact_pc; /* pc is where the thread stopped, not a return address */
};

/* A binary search, one step per bpf_loop iteration (the verifier checks a
 * step once instead of every path through an unrolled search). */
struct search_ctx {
	struct rprof_space *space; /* mappings: by start */
	__u32 first;		   /* rows: from unwind_rows[first] */
	__u32 lo;
	__u32 hi;
	__u32 pad;
	__u64 key; /* find the last entry at or below key */
};

static long mapping_step(__u32 i, struct search_ctx *c)
{
	__u32 mid;

	if (c->lo >= c->hi)
		return 1;
	mid = (c->lo + c->hi) / 2;
	if (c->space->mappings[mid & (RPROF_MAX_MAPPINGS - 1)].start <= c->key)
		c->lo = mid + 1;
	else
		c->hi = mid;
	return 0;
}

static long row_step(__u32 i, struct search_ctx *c)
{
	struct rprof_unwind_row *row;
	__u32 mid, key;

	if (c->lo >= c->hi)
		return 1;
	mid = (c->lo + c->hi) / 2;
	key = c->first + mid;
	row = bpf_map_lookup_elem(&unwind_rows, &key);
	if (!row)
		return 1;
	if (row->pc <= c->key)
		c->lo = mid + 1;
	else
		c->hi = mid;
	return 0;
}

/* How many of the mappings of `space` start at or below `addr`. A global
 * function, which the verifier checks once: inlined into each frame's
 * unwinding, its search was checked again at every path to it (over half
 * of the --native program's checking, and a quarter second of its start). */
__noinline __u64 mappings_below(struct rprof_space *space, __u64 addr)
{
	struct search_ctx c = {.space = space, .key = addr};

	if (!space)
		return 0;
	c.hi = space->count;
	if (c.hi > RPROF_MAX_MAPPINGS)
		c.hi = RPROF_MAX_MAPPINGS;
	bpf_loop(MAPPING_SEARCH_STEPS, mapping_step, &c, 0);
	return c.lo;
}

static __always_inline struct rprof_mapping *find_mapping(struct rprof_space *space, __u64 addr)
{
	__u64 below = mappings_below(space, addr);
	struct rprof_mapping *m;

	if (below == 0 || below > RPROF_MAX_MAPPINGS)
		return 0;
	/* Masked: the verifier knows nothing of a global function's result. */
	m = &space->mappings[(below - 1) & (RPROF_MAX_MAPPINGS - 1)];
	return addr < m->end ? m : 0;
}

/* The rule for vaddr `pc` of `file`; 0 when no row covers it (the rows end
 * with a RPROF_CFA_NONE row past the last function, and fill gaps between
 * functions with one). `*func` gets where pc's function starts, or 0. */
static __always_inline struct rprof_unwind_rule *find_rule(struct rprof_unwind_file *file, __u64 pc,
							   __u64 *func)
{
	struct search_ctx c = {.first = file->first, .hi = file->count};
	struct rprof_unwind_row *row;
	__u32 key, page, *at;

	if (pc < file->base || pc - file->base > 0xffffffffULL || !c.hi)
		return 0;
	c.key = pc - file->base;
	/* Only the rows of pc's page: from the one covering its start to the
	 * one covering the next page's. */
	page = c.key >> RPROF_UNWIND_PAGE_SHIFT;
	if (page < file->pages) {
		key = file->first_page + page;
		at = bpf_map_lookup_elem(&unwind_pages, &key);
		if (at && *at < c.hi)
			c.lo = *at;
		key++;
		at = page + 1 < file->pages ? bpf_map_lookup_elem(&unwind_pages, &key) : 0;
		if (at && *at + 1 < c.hi && *at + 1 > c.lo)
			c.hi = *at + 1;
	}
	bpf_loop(ROW_SEARCH_STEPS, row_step, &c, 0);
	if (c.lo == 0)
		return 0;
	key = c.first + c.lo - 1;
	row = bpf_map_lookup_elem(&unwind_rows, &key);
	if (!row)
		return 0;
	if (row->back != 0xffff && row->back < c.lo) {
		__u32 at = key - row->back;
		struct rprof_unwind_row *first = bpf_map_lookup_elem(&unwind_rows, &at);

		if (first)
			*func = file->base + first->pc;
	}
	key = row->rule;
	return bpf_map_lookup_elem(&unwind_rules, &key);
}

static __always_inline int read_word(__u64 addr, __u64 *v)
{
	return bpf_probe_read_user(v, sizeof(*v), (void *)addr);
}

/* Steps through a frame by its frame pointer: rbp points at the saved rbp,
 * above it the return address. */
static __always_inline int frame_pointer_step(struct unwind_ctx *u, __u64 *cfa)
{
	__u64 saved[2];

	if (!u->bp_known || u->bp < u->sp || u->bp - u->sp > MAX_FRAME_BYTES || (u->bp & 7))
		return -1;
	if (bpf_probe_read_user(saved, sizeof(saved), (void *)u->bp))
		return -1;
	*cfa = u->bp + 16;
	u->bp = saved[0];
	return 0;
}

/* The canonical frame address by `rule` (the return address is below it). */
static __always_inline int rule_cfa(struct unwind_ctx *u, struct rprof_unwind_rule *rule, bool leaf,
				    __u64 *cfa)
{
	__u64 base;

	switch (rule->cfa) {
	case RPROF_CFA_RSP:
		*cfa = u->sp + rule->cfa_off;
		return 0;
	case RPROF_CFA_RBP:
		if (!u->bp_known)
			return -1;
		*cfa = u->bp + rule->cfa_off;
		return 0;
	case RPROF_CFA_REG:
		/* Only the leaf frame knows every register (prologues that
		 * realign the stack). */
		if (!leaf)
			return -1;
		*cfa = u->regs[rule->reg & 15] + rule->cfa_off;
		return 0;
	case RPROF_CFA_DEREF:
		if (rule->reg == 7)
			base = u->sp;
		else if (rule->reg == 6 && u->bp_known)
			base = u->bp;
		else
			return -1;
		if (read_word(base + rule->cfa_off, cfa))
			return -1;
		*cfa += rule->deref_off;
		return 0;
	case RPROF_CFA_PLT:
		*cfa = u->sp + 8 + ((u->pc & 15) >= (__u64)rule->cfa_off ? 8 : 0);
		return 0;
	default:
		return -1;
	}
}

/* One native frame: record where it is, then step to its caller. */
static long unwind_step(__u32 i, struct unwind_ctx *u)
{
	struct rprof_unwind_rule *rule = 0;
	struct rprof_unwind_file *file = 0;
	struct rprof_native_frame *f;
	struct rprof_mapping *m;
	__u64 addr, cfa = 0, ra = 0, old_sp = u->sp, func = 0;
	__u32 key, slot;

	/* The loop index, not a count kept in `u`: the verifier does not know
	 * its value, so it checks this step once rather than once per frame. */
	if (i >= RPROF_MAX_NATIVE) {
		u->stop = RPROF_NATIVE_TRUNCATED;
		return 1;
	}
	/* A return address is just past its call: look the call up instead. */
	addr = u->exact_pc ? u->pc : u->pc - 1;
	m = u->last;
	if (!m || addr < m->start || addr >= m->end)
		m = find_mapping(u->space, addr);
	u->last = m;
	slot = i;
	/* Keep the mask the check above makes look redundant to clang. */
	asm volatile("" : "+r"(slot));
	f = &u->out[slot & (RPROF_MAX_NATIVE - 1)];
	f->addr = addr;
	f->file = 0;
	f->pad = 0;
	u->n = i + 1;
	if (m && m->kind == RPROF_MAPPING_FILE && m->file) {
		f->addr = addr - m->bias;
		f->file = m->file;
		key = m->file;
		file = bpf_map_lookup_elem(&unwind_files, &key);
		if (file)
			rule = find_rule(file, f->addr, &func);
		/* A frame is its function: stacks that differ only in where
		 * their functions are at are counted as one, in the kernel. */
		if (rule && func && rule->cfa != RPROF_CFA_NONE && rule->cfa != RPROF_CFA_SIGNAL)
			f->addr = func;
	}
	u->hash = mix(u->hash, f->addr ^ ((__u64)f->file << 44));
	if (!m) {
		u->stop = RPROF_NATIVE_NO_MAPPING;
		return 1;
	}

	if (rule && rule->cfa == RPROF_CFA_END) {
		u->stop = RPROF_NATIVE_DONE;
		return 1;
	}
	if (rule && rule->cfa == RPROF_CFA_SIGNAL) {
		/* The interrupted code's registers, saved by the kernel. */
		__u64 base = u->sp + SIGFRAME_MCONTEXT;

		/* A handler returns to the trampoline's first instruction: name
		 * that, not the byte before it (which only its CFI covers). */
		if (!u->exact_pc)
			f->addr++;

		if (read_word(base + SIGCONTEXT_RIP, &u->pc) ||
		    read_word(base + SIGCONTEXT_RSP, &u->sp) ||
		    read_word(base + SIGCONTEXT_RBP, &u->bp)) {
			u->stop = RPROF_NATIVE_READ_FAILED;
			return 1;
		}
		u->bp_known = true;
		u->exact_pc = true;
		return u->pc ? 0 : 1;
	}
	if (!rule || rule->cfa == RPROF_CFA_NONE) {
		/* No CFI here: only code known to keep frame pointers is followed. */
		bool fp = m->kind == RPROF_MAPPING_JIT ||
			  (file && (file->flags & RPROF_FILE_FRAME_POINTERS));

		if (!fp || frame_pointer_step(u, &cfa)) {
			u->stop =
			    m->kind == RPROF_MAPPING_JIT ? RPROF_NATIVE_JIT : RPROF_NATIVE_NO_CFI;
			return 1;
		}
	} else {
		if (rule_cfa(u, rule, i == 0, &cfa)) {
			u->stop = RPROF_NATIVE_UNSUPPORTED;
			return 1;
		}
		if (rule->rbp == RPROF_RBP_AT_CFA && rule->rbp_off == -16) {
			/* The usual frame: saved rbp right below the return
			 * address, both in one read. */
			__u64 saved[2];

			if (bpf_probe_read_user(saved, sizeof(saved), (void *)(cfa - 16))) {
				u->stop = RPROF_NATIVE_READ_FAILED;
				return 1;
			}
			u->bp = saved[0];
			ra = saved[1];
			u->bp_known = true;
			goto step;
		}
		if (rule->rbp == RPROF_RBP_AT_CFA) {
			if (read_word(cfa + rule->rbp_off, &u->bp)) {
				u->stop = RPROF_NATIVE_READ_FAILED;
				return 1;
			}
			u->bp_known = true;
		} else if (rule->rbp == RPROF_RBP_UNKNOWN) {
			u->bp_known = false;
		}
	}
	if (read_word(cfa - 8, &ra)) {
		u->stop = RPROF_NATIVE_READ_FAILED;
		return 1;
	}
step:
	/* The caller's frame is above this one; a zero return address ends
	 * the stack (the ABI's convention for the outermost frame). */
	if (!ra) {
		u->stop = RPROF_NATIVE_DONE;
		return 1;
	}
	if (cfa <= old_sp) {
		u->stop = RPROF_NATIVE_BAD_FRAME;
		return 1;
	}
	u->sp = cfa;
	u->pc = ra;
	u->exact_pc = false;
	return 0;
}

/* Copies the user registers of `task` into `u` (pt_regs saved when it
 * entered the kernel, whatever the event). */
static __always_inline int read_user_regs(struct task_struct *task, struct unwind_ctx *u)
{
	struct pt_regs *r = (struct pt_regs *)bpf_task_pt_regs(task);

	if (!r)
		return -1;
	u->regs[0] = BPF_CORE_READ(r, ax);
	u->regs[1] = BPF_CORE_READ(r, dx);
	u->regs[2] = BPF_CORE_READ(r, cx);
	u->regs[3] = BPF_CORE_READ(r, bx);
	u->regs[4] = BPF_CORE_READ(r, si);
	u->regs[5] = BPF_CORE_READ(r, di);
	u->regs[6] = BPF_CORE_READ(r, bp);
	u->regs[7] = BPF_CORE_READ(r, sp);
	u->regs[8] = BPF_CORE_READ(r, r8);
	u->regs[9] = BPF_CORE_READ(r, r9);
	u->regs[10] = BPF_CORE_READ(r, r10);
	u->regs[11] = BPF_CORE_READ(r, r11);
	u->regs[12] = BPF_CORE_READ(r, r12);
	u->regs[13] = BPF_CORE_READ(r, r13);
	u->regs[14] = BPF_CORE_READ(r, r14);
	u->regs[15] = BPF_CORE_READ(r, r15);
	u->pc = BPF_CORE_READ(r, ip);
	u->sp = u->regs[7];
	u->bp = u->regs[6];
	return 0;
}

/* Unwinds the native stack of the current thread into `out`, with the
 * address space `space`; returns the number of frames, and in `u` why it
 * ended and the frames' hash. */
static __always_inline __u32 unwind_native(struct unwind_ctx *u, struct rprof_native_frame *out,
					   __u32 space)
{
	u->out = out;
	u->stop = RPROF_NATIVE_DONE;
	u->bp_known = true;
	u->exact_pc = true;
	u->space = space ? bpf_map_lookup_elem(&spaces, &space) : 0;
	if (!u->space)
		u->stop = RPROF_NATIVE_NO_SPACE;
	else if (read_user_regs(bpf_get_current_task_btf(), u))
		u->stop = RPROF_NATIVE_READ_FAILED;
	else
		bpf_loop(RPROF_MAX_NATIVE + 1, unwind_step, u, 0);
	return u->n > RPROF_MAX_NATIVE ? RPROF_MAX_NATIVE : u->n;
}

#endif /* RPROF_NATIVE_BPF_H */
