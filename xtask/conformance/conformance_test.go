// The official Gateway API conformance suite (sigs.k8s.io/gateway-api/conformance), run by
// `cargo xtask conformance` against the local cluster with no containers (haptic-node).
//
// It is the upstream TestConformance (conformance.RunConformance: every flag of the suite,
// -gateway-class, -supported-features, -conformance-profiles, -report-output, ...) with one
// change: the suite's base manifests lose the `coredns` Deployment. Its image is not one the
// process kubelet can run (no containers: only echo-basic and the project's own images are
// mapped to binaries), so its Pod would never be Ready and the suite's setup, which waits for
// every Pod of its namespaces, would fail every test. It serves the UDPRoute tests only, which
// no profile run here includes. Nothing else in the manifests or the tests is changed.
package haptic

import (
	"bytes"
	"io"
	"io/fs"
	"testing"
	"time"

	"sigs.k8s.io/gateway-api/conformance"
)

const baseManifests = "base/manifests.yaml"

// withoutCoreDNS serves the suite's embedded manifests, base/manifests.yaml less the coredns
// Deployment.
type withoutCoreDNS struct{ fs.FS }

func (w withoutCoreDNS) Open(name string) (fs.File, error) {
	file, err := w.FS.Open(name)
	if err != nil || name != baseManifests {
		return file, err
	}
	defer file.Close()
	data, err := io.ReadAll(file)
	if err != nil {
		return nil, err
	}
	var kept [][]byte
	for _, doc := range bytes.Split(data, []byte("\n---\n")) {
		if bytes.Contains(doc, []byte("\nkind: Deployment\n")) &&
			bytes.Contains(doc, []byte("\n  name: coredns\n")) {
			continue
		}
		kept = append(kept, doc)
	}
	info, err := file.Stat()
	if err != nil {
		return nil, err
	}
	return &memFile{Reader: bytes.NewReader(bytes.Join(kept, []byte("\n---\n"))), info: info}, nil
}

type memFile struct {
	*bytes.Reader
	info fs.FileInfo
}

func (m *memFile) Stat() (fs.FileInfo, error) { return sizedInfo{m.info, m.Reader.Size()}, nil }
func (m *memFile) Close() error               { return nil }

type sizedInfo struct {
	fs.FileInfo
	size int64
}

func (s sizedInfo) Size() int64        { return s.size }
func (s sizedInfo) ModTime() time.Time { return s.FileInfo.ModTime() }

func TestConformance(t *testing.T) {
	opts := conformance.DefaultOptions(t)
	opts.ManifestFS = []fs.FS{withoutCoreDNS{&conformance.Manifests}}
	conformance.RunConformanceWithOptions(t, opts)
}
