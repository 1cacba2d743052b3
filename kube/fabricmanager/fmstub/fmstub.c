/*
 * fmstub: a stand-in for NVIDIA Fabric Manager (FM) behind its client library, for
 * passage's tests only. It is built by the tests (package fabricmanager/fabrictest) into a
 * libnvfm.so of its own against go-nvfm's copy of the FM SDK headers (nv_fm_agent.h,
 * nv_fm_types.h, taken from the Go module cache at test time, never copied here), and
 * go-nvfm loads it through its real dlopen path. No FM, NVSwitch or libnvfm is involved:
 * what it answers is what NVLINK.md's sources say FM answers, not what an FM was seen to.
 *
 * What it keeps is FM's partition state machine in shared NVSwitch mode (FABRIC_MODE=1)
 * for an HGX B200/B300 baseboard: the 15 predefined partitions of the FM User Guide's
 * "DGX B200/B300 and NVIDIA HGX B200/B300" table, members named by physicalId = GPU
 * Module ID, uuid and pciBusId left empty as FM leaves them on H100 and later.
 *
 * The state lives in the file $PASSAGE_FMSTUB_STATE, so every process that loads the
 * stub (the plugin, passage-dra fabric check, the test itself) talks to one FM; each
 * call holds flock(LOCK_EX) on it from read to write. Its lines are key=value:
 *
 *   mode=serving|restarting|exited|gone   gone: FM is not running (connects fail)
 *   epoch=N               bumped at each FM start: a handle from before is not valid
 *   active=1,4            the active partition IDs
 *   restart_at_ms=T       (restarting) when FM started with --restart, Unix ms
 *   window_ms=W           how long FM waits for fmSetActivatedFabricPartitions (60000)
 *   refuse_list=C         a forced return code for the partition query (0: none)
 *   refuse_activate=C     ... for activation
 *   refuse_deactivate=C   ... for deactivation
 *   fmug_codes=1          already-active and not-active are answered FM_ST_IN_USE and
 *                         FM_ST_UNINITIALIZED, as the FM User Guide documents; without,
 *                         FM_ST_PARTITION_ID_IN_USE and _NOT_IN_USE, as current FMs
 *                         are inferred to answer (Ubicloud accepts fmpm's 239 and 238)
 *   links=M:N,...         module M has N NVLinks available in its multi-GPU partitions
 *   listen=unix:PATH | inet:HOST:PORT   where FM listens ("" or absent: anywhere)
 *   stale_code=C          what a call on a dead connection (FM gone, exited, or
 *                         restarted since it was made) is answered: 0 or absent,
 *                         FM_ST_CONNECTION_NOT_VALID; libnvfm's answer to a socket whose
 *                         peer is gone is not documented, so tests also give
 *                         FM_ST_TIMEOUT, FM_ST_GENERIC_ERROR or FM_ST_UNINITIALIZED
 *
 * Each call is appended to $PASSAGE_FMSTUB_STATE.log as "<call> <argument> = <code>".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "nv_fm_agent.h"

#define NUM_PARTITIONS 15
#define NUM_MODULES 8
/* HGX B200/B300: 18 NVLinks per GPU, 9 to each of the two NVSwitch ASICs (FM User Guide). */
#define NVLINKS_PER_GPU 18
/* FM's rule: after a --restart, the active list must arrive within 60 s or FM exits
 * (FM User Guide, "Resiliency"). The state file's window_ms may shorten it for tests. */
#define RESTART_WINDOW_MS 60000LL

static const struct {
	unsigned int id, num;
	unsigned int modules[NUM_MODULES];
} partitions[NUM_PARTITIONS] = {
	{1, 8, {1, 2, 3, 4, 5, 6, 7, 8}},
	{2, 4, {1, 2, 3, 4}}, {3, 4, {5, 6, 7, 8}},
	{4, 2, {1, 2}}, {5, 2, {3, 4}}, {6, 2, {5, 6}}, {7, 2, {7, 8}},
	{8, 1, {1}}, {9, 1, {2}}, {10, 1, {3}}, {11, 1, {4}},
	{12, 1, {5}}, {13, 1, {6}}, {14, 1, {7}}, {15, 1, {8}},
};

struct state {
	char mode[16];
	unsigned long epoch;
	int active[NUM_PARTITIONS + 1]; /* by partition ID */
	long long restart_at_ms, window_ms;
	int refuse_list, refuse_activate, refuse_deactivate;
	int fmug_codes;
	int links[NUM_MODULES + 1]; /* by module ID */
	char listen[FM_MAX_STR_LENGTH + 8];
	int stale_code;
};

#define HANDLE_MAGIC 0x464d5342u
struct handle {
	unsigned int magic;
	unsigned long epoch;
};

static int initialized;

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int partition_index(unsigned int id)
{
	for (int i = 0; i < NUM_PARTITIONS; i++)
		if (partitions[i].id == id)
			return i;
	return -1;
}

static int shares_module(int a, int b)
{
	for (unsigned int i = 0; i < partitions[a].num; i++)
		for (unsigned int j = 0; j < partitions[b].num; j++)
			if (partitions[a].modules[i] == partitions[b].modules[j])
				return 1;
	return 0;
}

static int parse(struct state *st, char *buf)
{
	memset(st, 0, sizeof(*st));
	strcpy(st->mode, "serving");
	st->window_ms = RESTART_WINDOW_MS;
	for (int m = 1; m <= NUM_MODULES; m++)
		st->links[m] = NVLINKS_PER_GPU;
	for (char *save = NULL, *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *v = strchr(line, '=');
		if (!v || line[0] == '#')
			continue;
		*v++ = 0;
		if (!strcmp(line, "mode")) {
			snprintf(st->mode, sizeof(st->mode), "%s", v);
		} else if (!strcmp(line, "epoch")) {
			st->epoch = strtoul(v, NULL, 10);
		} else if (!strcmp(line, "active")) {
			for (char *s2 = NULL, *id = strtok_r(v, ",", &s2); id; id = strtok_r(NULL, ",", &s2)) {
				int i = partition_index((unsigned int)strtoul(id, NULL, 10));
				if (i < 0)
					return -1;
				st->active[partitions[i].id] = 1;
			}
		} else if (!strcmp(line, "restart_at_ms")) {
			st->restart_at_ms = strtoll(v, NULL, 10);
		} else if (!strcmp(line, "window_ms")) {
			st->window_ms = strtoll(v, NULL, 10);
		} else if (!strcmp(line, "refuse_list")) {
			st->refuse_list = atoi(v);
		} else if (!strcmp(line, "refuse_activate")) {
			st->refuse_activate = atoi(v);
		} else if (!strcmp(line, "refuse_deactivate")) {
			st->refuse_deactivate = atoi(v);
		} else if (!strcmp(line, "fmug_codes")) {
			st->fmug_codes = atoi(v);
		} else if (!strcmp(line, "links")) {
			for (char *s2 = NULL, *ml = strtok_r(v, ",", &s2); ml; ml = strtok_r(NULL, ",", &s2)) {
				int m, n;
				if (sscanf(ml, "%d:%d", &m, &n) != 2 || m < 1 || m > NUM_MODULES || n < 0)
					return -1;
				st->links[m] = n;
			}
		} else if (!strcmp(line, "listen")) {
			snprintf(st->listen, sizeof(st->listen), "%s", v);
		} else if (!strcmp(line, "stale_code")) {
			st->stale_code = atoi(v);
		} else {
			return -1; /* a key the stand-in does not know: a test's typo, not ignored */
		}
	}
	return 0;
}

static void format(const struct state *st, FILE *f)
{
	fprintf(f, "mode=%s\nepoch=%lu\nactive=", st->mode, st->epoch);
	const char *sep = "";
	for (int id = 1; id <= NUM_PARTITIONS; id++)
		if (st->active[id]) {
			fprintf(f, "%s%d", sep, id);
			sep = ",";
		}
	fprintf(f, "\nrestart_at_ms=%lld\nwindow_ms=%lld\nrefuse_list=%d\nrefuse_activate=%d\nrefuse_deactivate=%d\nfmug_codes=%d\nlinks=",
		st->restart_at_ms, st->window_ms, st->refuse_list, st->refuse_activate, st->refuse_deactivate, st->fmug_codes);
	sep = "";
	for (int m = 1; m <= NUM_MODULES; m++) {
		fprintf(f, "%s%d:%d", sep, m, st->links[m]);
		sep = ",";
	}
	fprintf(f, "\nlisten=%s\nstale_code=%d\n", st->listen, st->stale_code);
}

/* session is one call's hold on the state file. */
struct session {
	int fd;
	struct state st, before;
};

/* begin locks and reads the state; -1 when there is no FM to talk to (no state file). */
static int begin(struct session *s)
{
	const char *p = getenv("PASSAGE_FMSTUB_STATE");
	char buf[8192];
	if (!p || !*p)
		return -1;
	s->fd = open(p, O_RDWR | O_CLOEXEC);
	if (s->fd < 0)
		return -1;
	if (flock(s->fd, LOCK_EX) != 0) {
		close(s->fd);
		return -1;
	}
	ssize_t n = pread(s->fd, buf, sizeof(buf) - 1, 0);
	if (n < 0 || n == (ssize_t)sizeof(buf) - 1) {
		close(s->fd);
		return -1;
	}
	buf[n] = 0;
	if (parse(&s->st, buf) != 0) {
		fprintf(stderr, "fmstub: %s: malformed state\n", p);
		close(s->fd);
		return -1;
	}
	s->before = s->st;
	/* FM's rule: no active list within the window after a --restart, FM exits. */
	if (!strcmp(s->st.mode, "restarting") && now_ms() > s->st.restart_at_ms + s->st.window_ms)
		strcpy(s->st.mode, "exited");
	return 0;
}

/* end writes the state back when the call changed it, logs the call and unlocks. */
static fmReturn_t end(struct session *s, const char *call, const char *arg, fmReturn_t ret)
{
	if (memcmp(&s->st, &s->before, sizeof(s->st)) != 0) {
		char *buf = NULL;
		size_t len = 0;
		FILE *f = open_memstream(&buf, &len);
		if (f) {
			format(&s->st, f);
			fclose(f);
			if (pwrite(s->fd, buf, len, 0) != (ssize_t)len || ftruncate(s->fd, (off_t)len) != 0)
				ret = FM_ST_GENERIC_ERROR;
			free(buf);
		}
	}
	const char *p = getenv("PASSAGE_FMSTUB_STATE");
	char logp[4096];
	snprintf(logp, sizeof(logp), "%s.log", p);
	FILE *log = fopen(logp, "ae");
	if (log) {
		fprintf(log, "%s %s = %d\n", call, arg, (int)ret);
		fclose(log);
	}
	flock(s->fd, LOCK_UN);
	close(s->fd);
	return ret;
}

/* stale is the answer to a call on a dead connection. */
static fmReturn_t stale(const struct session *s)
{
	return s->st.stale_code ? (fmReturn_t)s->st.stale_code : FM_ST_CONNECTION_NOT_VALID;
}

/* serving is the check every call on a connection makes before FM acts on it. */
static fmReturn_t serving(struct session *s, struct handle *h)
{
	if (!strcmp(s->st.mode, "gone") || !strcmp(s->st.mode, "exited"))
		return stale(s);
	if (h->epoch != s->st.epoch)
		return stale(s); /* FM restarted since this connection */
	if (!strcmp(s->st.mode, "restarting"))
		return FM_ST_NOT_CONFIGURED; /* "Fabric Manager instance is initializing" */
	return FM_ST_SUCCESS;
}

static struct handle *valid(fmHandle_t h)
{
	struct handle *hp = h;
	return hp && hp->magic == HANDLE_MAGIC ? hp : NULL;
}

fmReturn_t fmLibInit(void)
{
	if (initialized)
		return FM_ST_IN_USE; /* nv_fm_agent.h: "already in initialized state" */
	initialized = 1;
	return FM_ST_SUCCESS;
}

fmReturn_t fmLibShutdown(void)
{
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	initialized = 0;
	return FM_ST_SUCCESS;
}

fmReturn_t fmConnect(fmConnectParams_t *params, fmHandle_t *pFmHandle)
{
	struct session s;
	char addr[FM_MAX_STR_LENGTH + 16], info[FM_MAX_STR_LENGTH];
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!params || !pFmHandle)
		return FM_ST_BADPARAM;
	if (params->version != fmConnectParams_version)
		return FM_ST_VERSION_MISMATCH;
	snprintf(info, sizeof(info), "%.*s", (int)sizeof(params->addressInfo), params->addressInfo);
	switch (params->addressType) {
	case NV_FM_API_ADDR_TYPE_UNIX:
		snprintf(addr, sizeof(addr), "unix:%s", info);
		break;
	case NV_FM_API_ADDR_TYPE_INET:
		/* "<ipv4>:<port_number>"; a bare address is FM's FM_CMD_PORT_NUMBER. */
		snprintf(addr, sizeof(addr), strchr(info, ':') ? "inet:%s" : "inet:%s:6666", info);
		break;
	case NV_FM_API_ADDR_TYPE_VSOCK:
		snprintf(addr, sizeof(addr), "vsock:%s", info);
		break;
	default:
		return FM_ST_BADPARAM;
	}
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID; /* "if the FM instance could not be reached" */
	fmReturn_t ret = FM_ST_SUCCESS;
	if (!strcmp(s.st.mode, "gone") || !strcmp(s.st.mode, "exited") || (s.st.listen[0] && strcmp(s.st.listen, addr)))
		ret = FM_ST_CONNECTION_NOT_VALID;
	if (ret == FM_ST_SUCCESS) {
		struct handle *h = calloc(1, sizeof(*h));
		if (!h) {
			ret = FM_ST_GENERIC_ERROR;
		} else {
			h->magic = HANDLE_MAGIC;
			h->epoch = s.st.epoch;
			*pFmHandle = h;
		}
	}
	return end(&s, "connect", addr, ret);
}

fmReturn_t fmDisconnect(fmHandle_t pFmHandle)
{
	struct handle *h = valid(pFmHandle);
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h)
		return FM_ST_BADPARAM;
	h->magic = 0;
	free(h);
	return FM_ST_SUCCESS;
}

fmReturn_t fmGetSupportedFabricPartitions(fmHandle_t pFmHandle, fmFabricPartitionList_t *list)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h || !list)
		return FM_ST_BADPARAM;
	if (list->version != fmFabricPartitionList_version)
		return FM_ST_VERSION_MISMATCH;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	fmReturn_t ret = serving(&s, h);
	if (ret == FM_ST_SUCCESS && s.st.refuse_list)
		ret = (fmReturn_t)s.st.refuse_list;
	if (ret == FM_ST_SUCCESS) {
		unsigned int version = list->version;
		memset(list, 0, sizeof(*list));
		list->version = version;
		list->numPartitions = NUM_PARTITIONS;
		list->maxNumPartitions = FM_MAX_FABRIC_PARTITIONS;
		for (int i = 0; i < NUM_PARTITIONS; i++) {
			fmFabricPartitionInfo_t *p = &list->partitionInfo[i];
			p->partitionId = partitions[i].id;
			p->isActive = (unsigned int)s.st.active[partitions[i].id];
			p->numGpus = partitions[i].num;
			for (unsigned int g = 0; g < partitions[i].num; g++) {
				unsigned int m = partitions[i].modules[g];
				p->gpuInfo[g].physicalId = m;
				/* A single-GPU partition has its NVLinks off: 0 in the guide's table. */
				if (partitions[i].num > 1) {
					p->gpuInfo[g].numNvLinksAvailable = (unsigned int)s.st.links[m];
					p->gpuInfo[g].maxNumNvLinks = NVLINKS_PER_GPU;
				}
				/* No source gives B300's per-link rate: nvlinkLineRateMBps stays 0. */
			}
		}
	}
	return end(&s, "list", "-", ret);
}

fmReturn_t fmActivateFabricPartition(fmHandle_t pFmHandle, fmFabricPartitionId_t partitionId)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	char arg[16];
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h)
		return FM_ST_BADPARAM;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	snprintf(arg, sizeof(arg), "%u", partitionId);
	int i = partition_index(partitionId);
	fmReturn_t ret = serving(&s, h);
	if (ret == FM_ST_SUCCESS && s.st.refuse_activate)
		ret = (fmReturn_t)s.st.refuse_activate;
	if (ret == FM_ST_SUCCESS && i < 0)
		ret = FM_ST_BADPARAM; /* "unsupported partition id" */
	if (ret == FM_ST_SUCCESS && s.st.active[partitionId])
		ret = s.st.fmug_codes ? FM_ST_IN_USE : FM_ST_PARTITION_ID_IN_USE;
	for (int j = 0; ret == FM_ST_SUCCESS && j < NUM_PARTITIONS; j++)
		if (s.st.active[partitions[j].id] && shares_module(i, j))
			ret = FM_ST_IN_USE; /* a GPU of it is in another active partition */
	if (ret == FM_ST_SUCCESS)
		s.st.active[partitionId] = 1;
	return end(&s, "activate", arg, ret);
}

fmReturn_t fmActivateFabricPartitionWithVFs(fmHandle_t pFmHandle, fmFabricPartitionId_t partitionId, fmPciDevice_t *vfList, unsigned int numVfs)
{
	(void)partitionId, (void)vfList, (void)numVfs;
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!valid(pFmHandle))
		return FM_ST_BADPARAM;
	return FM_ST_NOT_SUPPORTED; /* the vGPU model's call (FABRIC_MODE=2); this FM is shared mode */
}

fmReturn_t fmDeactivateFabricPartition(fmHandle_t pFmHandle, fmFabricPartitionId_t partitionId)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	char arg[16];
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h)
		return FM_ST_BADPARAM;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	snprintf(arg, sizeof(arg), "%u", partitionId);
	fmReturn_t ret = serving(&s, h);
	if (ret == FM_ST_SUCCESS && s.st.refuse_deactivate)
		ret = (fmReturn_t)s.st.refuse_deactivate;
	if (ret == FM_ST_SUCCESS && partition_index(partitionId) < 0)
		ret = FM_ST_BADPARAM;
	if (ret == FM_ST_SUCCESS && !s.st.active[partitionId])
		ret = s.st.fmug_codes ? FM_ST_UNINITIALIZED : FM_ST_PARTITION_ID_NOT_IN_USE;
	if (ret == FM_ST_SUCCESS)
		s.st.active[partitionId] = 0;
	return end(&s, "deactivate", arg, ret);
}

fmReturn_t fmSetActivatedFabricPartitions(fmHandle_t pFmHandle, fmActivatedFabricPartitionList_t *list)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	char arg[256] = "";
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h || !list)
		return FM_ST_BADPARAM;
	if (list->version != fmActivatedFabricPartitionList_version)
		return FM_ST_VERSION_MISMATCH;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	fmReturn_t ret = FM_ST_SUCCESS;
	if (!strcmp(s.st.mode, "gone") || !strcmp(s.st.mode, "exited") || h->epoch != s.st.epoch)
		ret = stale(&s);
	else if (strcmp(s.st.mode, "restarting"))
		/* Unverified: FM's answer to a list outside a --restart is undocumented; the
		 * stand-in refuses it, so a client that sends one unasked is seen. */
		ret = FM_ST_NOT_SUPPORTED;
	else if (list->numPartitions > FM_MAX_FABRIC_PARTITIONS)
		ret = FM_ST_BADPARAM;
	int active[NUM_PARTITIONS + 1] = {0};
	for (unsigned int k = 0; ret == FM_ST_SUCCESS && k < list->numPartitions; k++) {
		unsigned int id = list->partitionIds[k];
		int i = partition_index(id);
		size_t n = strlen(arg);
		snprintf(arg + n, sizeof(arg) - n, "%s%u", n ? "," : "", id);
		if (i < 0 || active[id]) {
			ret = FM_ST_BADPARAM;
			break;
		}
		for (int j = 0; j < NUM_PARTITIONS; j++)
			if (active[partitions[j].id] && shares_module(i, j))
				ret = FM_ST_BADPARAM; /* two active partitions cannot share a GPU */
		active[id] = 1;
	}
	if (ret == FM_ST_SUCCESS) {
		memcpy(s.st.active, active, sizeof(active));
		strcpy(s.st.mode, "serving");
	}
	return end(&s, "set_activated", arg[0] ? arg : "-", ret);
}

fmReturn_t fmGetNvlinkFailedDevices(fmHandle_t pFmHandle, fmNvlinkFailedDevices_t *devices)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h || !devices)
		return FM_ST_BADPARAM;
	if (devices->version != fmNvlinkFailedDevices_version)
		return FM_ST_VERSION_MISMATCH;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	fmReturn_t ret = serving(&s, h);
	if (ret == FM_ST_NOT_CONFIGURED)
		ret = FM_ST_NOT_SUPPORTED; /* not supported in --restart mode (FM User Guide) */
	if (ret == FM_ST_SUCCESS) {
		/* Always empty on H100 and later (nv_fm_agent.h). */
		unsigned int version = devices->version;
		memset(devices, 0, sizeof(*devices));
		devices->version = version;
	}
	return end(&s, "nvlink_failed", "-", ret);
}

fmReturn_t fmGetUnsupportedFabricPartitions(fmHandle_t pFmHandle, fmUnsupportedFabricPartitionList_t *list)
{
	struct session s;
	struct handle *h = valid(pFmHandle);
	if (!initialized)
		return FM_ST_UNINITIALIZED;
	if (!h || !list)
		return FM_ST_BADPARAM;
	if (list->version != fmUnsupportedFabricPartitionList_version)
		return FM_ST_VERSION_MISMATCH;
	if (begin(&s) != 0)
		return FM_ST_CONNECTION_NOT_VALID;
	fmReturn_t ret = serving(&s, h);
	if (ret == FM_ST_SUCCESS) {
		/* Always empty on H100 and later (nv_fm_agent.h). */
		unsigned int version = list->version;
		memset(list, 0, sizeof(*list));
		list->version = version;
	}
	return end(&s, "unsupported", "-", ret);
}
