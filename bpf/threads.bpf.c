// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The threads of one process, each with its thread pointer, read from the
 * kernel's task structs: the process is neither stopped nor touched. A BPF
 * object of its own, loaded in a millisecond, so that the layout proof (which
 * follows every thread's TLS to its EC, as the sampler will) can refuse a
 * process before rprof.bpf.c's programs are loaded: verifying those takes
 * the kernel a quarter of a second or more.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "rprof.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* The process whose threads `thread_pointers` lists (key 0). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} iter_tgid SEC(".maps");

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
