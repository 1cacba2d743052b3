package rootdev

import (
	"context"
	"strings"
	"testing"
)

// A tenant wrote the host root's filesystem UUID onto its passthrough NVMe: its device
// is never a candidate. With the real root present, the real root is found (not "2
// devices match"); while the real root's controller is still probing, Wait keeps
// waiting rather than returning the tenant's device, and says why it is not one.
func TestPassthroughDiskNeverRoot(t *testing.T) {
	nodes := node3()
	nodes["nvme2n1"] = node{sysPath: "pci0000:00/0000:00:13.0/0000:f4:00.0/nvme/nvme2/nvme2n1", data: ext4(rootUUID, "root")}
	passthrough := []string{"0000:f4:00.0", "0000:22:00.0"}
	root := tree(t, nodes)
	devs, err := Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []string{"UUID=9e2c1b3f-445d-4e6f-8091-a2b3c4d5e6f7", "LABEL=root"} {
		s, _ := Parse(spec)
		if d, err := Find(devs, s, passthrough); err != nil || d.Name != "nvme1n1p2" {
			t.Errorf("Find(%s) = %s, %v; want the real root nvme1n1p2", spec, d.Name, err)
		}
		if d, err := Find(devs, s, nil); err == nil {
			t.Errorf("without the passthrough list Find(%s) = %s: the test's tenant disk does not collide", spec, d.Name)
		}
	}

	// The real root's controller has not probed yet: only the tenant's disk carries the UUID.
	delete(nodes, "nvme1n1p2")
	delete(nodes, "nvme1n1")
	root = tree(t, nodes)
	s, _ := Parse("UUID=9e2c1b3f-445d-4e6f-8091-a2b3c4d5e6f7")
	ctx, cancel := context.WithTimeout(context.Background(), 3*Poll)
	defer cancel()
	dev, err := Wait(ctx, root, s, passthrough)
	if err == nil || dev != "" || !strings.Contains(err.Error(), "nvme2n1 (ext4 UUID=9e2c1b3f-445d-4e6f-8091-a2b3c4d5e6f7 LABEL=root) below passthrough function 0000:f4:00.0") {
		t.Errorf("Wait = %q, %v; want no device, the tenant's named as not a candidate", dev, err)
	}
}
