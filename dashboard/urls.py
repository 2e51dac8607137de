"""The tenant dashboard's URLs (namespace `dashboard`), mounted at `/`; views in dashboard/views/."""

from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard.views import (account, adapters, checkpoints, datasets, guides, overview, playground, tenants, training,
                             usage)

app_name = "dashboard"

urlpatterns = [
    path("", overview.overview_view, name="overview"),
    path("login/", account.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/", account.tenant_switch_view, name="tenant-switch"),
    path("datasets/", datasets.dataset_list_view, name="datasets"),
    path("datasets/upload/", datasets.dataset_upload_view, name="dataset-upload"),
    path("datasets/<int:dataset_id>/", datasets.dataset_detail_view, name="dataset"),
    path("datasets/<int:dataset_id>/delete/", datasets.dataset_delete_view, name="dataset-delete"),
    path("training/", training.job_list_view, name="jobs"),
    path("training/new/", training.job_new_view, name="job-new"),
    path("training/create/", training.job_create_view, name="job-create"),
    path("training/<int:job_id>/", training.job_detail_view, name="job"),
    path("training/<int:job_id>/cancel/", training.job_cancel_view, name="job-cancel"),
    path("training/<int:job_id>/pause/", training.job_pause_view, name="job-pause"),
    path("training/<int:job_id>/resume/", training.job_resume_view, name="job-resume"),
    path("training/<int:job_id>/checkpoints/<int:step>/version/", checkpoints.checkpoint_version_view,
         name="job-checkpoint-version"),
    path("adapters/", adapters.adapter_list_view, name="adapters"),
    path("adapters/create/", adapters.adapter_create_view, name="adapter-create"),
    path("adapters/<slug:name>/", adapters.adapter_detail_view, name="adapter"),
    path("adapters/<slug:name>/upload/", adapters.adapter_upload_view, name="adapter-upload"),
    path("adapters/<slug:name>/deploy/", adapters.adapter_deploy_view, name="adapter-deploy"),
    path("adapters/<slug:name>/canary/", adapters.adapter_canary_view, name="adapter-canary"),
    path("adapters/<slug:name>/promote/", adapters.adapter_promote_view, name="adapter-promote"),
    path("adapters/<slug:name>/abort/", adapters.adapter_abort_view, name="adapter-abort"),
    path("adapters/<slug:name>/rollback/", adapters.adapter_rollback_view, name="adapter-rollback"),
    path("adapters/<slug:name>/archive/", adapters.adapter_archive_view, name="adapter-archive"),
    path("playground/", playground.playground_view, name="playground"),
    path("playground/key/", playground.playground_key_view, name="playground-key"),
    path("usage/", usage.usage_view, name="usage"),
    path("usage.csv", usage.usage_csv_view, name="usage-csv"),
    path("keys/", tenants.api_key_list_view, name="keys"),
    path("keys/create/", tenants.api_key_create_view, name="key-create"),
    path("keys/<int:key_id>/limits/", tenants.api_key_update_view, name="key-update"),
    path("keys/<int:key_id>/revoke/", tenants.api_key_revoke_view, name="key-revoke"),
    path("guides/", guides.guide_index_view, name="guides"),
    path("guides/<slug:name>/", guides.guide_view, name="guide"),
    path("members/", tenants.member_list_view, name="members"),
    path("members/add/", tenants.member_add_view, name="member-add"),
    path("members/<int:membership_id>/role/", tenants.member_role_view, name="member-role"),
    path("members/<int:membership_id>/remove/", tenants.member_remove_view, name="member-remove"),
]
