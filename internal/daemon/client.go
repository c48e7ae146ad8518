package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
)

// GetStatus asks a running daemon for its status. target is either the
// daemon's gRPC socket path (its status socket is found beside it) or an
// http://host:port metrics address.
func GetStatus(ctx context.Context, target string) (Status, error) {
	var st Status
	err := get(ctx, target, "/status", &st)
	return st, err
}

// GetFootprints asks a running daemon for the footprints of the layers it
// serves: layer digest -> layerfmt.AnnotationPrefetch value (see
// layerstore.Store.Footprints). target is as for GetStatus.
func GetFootprints(ctx context.Context, target string) (map[string]string, error) {
	var fp map[string]string
	err := get(ctx, target, "/footprints", &fp)
	return fp, err
}

func get(ctx context.Context, target, path string, v any) error {
	url := strings.TrimSuffix(target, "/") + path
	client := http.DefaultClient
	if !strings.HasPrefix(target, "http://") && !strings.HasPrefix(target, "https://") {
		sock := StatusSocket(target)
		client = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
		}}
		url = "http://envsnap" + path
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("query daemon %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// The body says why (503: "not ready: restoring layer mounts").
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("query daemon %s: %s: %s", path, resp.Status, strings.TrimSpace(string(b)))
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("decode daemon %s: %w", path, err)
	}
	return nil
}
