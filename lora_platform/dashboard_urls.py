"""The tenant dashboard's URLs (namespace `dashboard`), mounted at `/`; views live in each app."""

from django.contrib.auth import views as auth_views
from django.urls import path

from lora_platform.views import overview_view
from serving import views as serving_views
from tenants import views as tenant_views
from training import views as training_views

app_name = "dashboard"

urlpatterns = [
    path("", overview_view, name="overview"),
    path("login/", tenant_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/", tenant_views.tenant_switch_view, name="tenant-switch"),
    path("datasets/", training_views.dataset_list_view, name="datasets"),
    path("datasets/upload/", training_views.dataset_upload_view, name="dataset-upload"),
    path("datasets/<int:dataset_id>/", training_views.dataset_detail_view, name="dataset"),
    path("datasets/<int:dataset_id>/delete/", training_views.dataset_delete_view, name="dataset-delete"),
    path("training/", training_views.job_list_view, name="jobs"),
    path("training/new/", training_views.job_new_view, name="job-new"),
    path("training/create/", training_views.job_create_view, name="job-create"),
    path("training/<int:job_id>/", training_views.job_detail_view, name="job"),
    path("training/<int:job_id>/cancel/", training_views.job_cancel_view, name="job-cancel"),
    path("adapters/", serving_views.adapter_list_view, name="adapters"),
    path("adapters/create/", serving_views.adapter_create_view, name="adapter-create"),
    path("adapters/<slug:name>/", serving_views.adapter_detail_view, name="adapter"),
    path("adapters/<slug:name>/upload/", serving_views.adapter_upload_view, name="adapter-upload"),
    path("adapters/<slug:name>/deploy/", serving_views.adapter_deploy_view, name="adapter-deploy"),
    path("adapters/<slug:name>/canary/", serving_views.adapter_canary_view, name="adapter-canary"),
    path("adapters/<slug:name>/promote/", serving_views.adapter_promote_view, name="adapter-promote"),
    path("adapters/<slug:name>/abort/", serving_views.adapter_abort_view, name="adapter-abort"),
    path("adapters/<slug:name>/rollback/", serving_views.adapter_rollback_view, name="adapter-rollback"),
    path("adapters/<slug:name>/archive/", serving_views.adapter_archive_view, name="adapter-archive"),
    path("playground/", serving_views.playground_view, name="playground"),
    path("playground/key/", serving_views.playground_key_view, name="playground-key"),
    path("usage/", serving_views.usage_view, name="usage"),
    path("usage.csv", serving_views.usage_csv_view, name="usage-csv"),
    path("keys/", tenant_views.api_key_list_view, name="keys"),
    path("keys/create/", tenant_views.api_key_create_view, name="key-create"),
    path("keys/<int:key_id>/revoke/", tenant_views.api_key_revoke_view, name="key-revoke"),
    path("members/", tenant_views.member_list_view, name="members"),
    path("members/add/", tenant_views.member_add_view, name="member-add"),
    path("members/<int:membership_id>/role/", tenant_views.member_role_view, name="member-role"),
    path("members/<int:membership_id>/remove/", tenant_views.member_remove_view, name="member-remove"),
]
